"""Engine configuration: one dataclass, resolved against the loaded model at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend_engine.free_queue import eviction_policy_name

SCHEDULING_POLICIES = ("priority", "fcfs")
KV_ROLES = ("both", "prefill", "decode")


@dataclass(slots=True)
class EngineConfig:
    model: str = "default"  # "default" | HF folder | .gguf file | "tiny-random[-llama|-qwen2|-mistral]"
    served_model_name: str | None = None  # the id clients use; defaults to the model's name
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16" (weights, activations and KV cache)
    quantization: str | None = None  # None: the checkpoint's own (awq/gptq) or none | "none" |
    #   "int8" | "int4" (quantise at load; a GGUF's tensors load directly) | "awq" | "gptq"
    quantization_group_size: int = 32  # int4 at load: input features per scale/min (32/64/128)
    device: str = "cpu"  # "cpu" | "cuda"
    enforce_eager: bool = False  # nothing compiled (vLLM's --enforce-eager): start-up in seconds
    engine_options: dict[str, str] = field(default_factory=dict)  # developer overrides of the
    #   execution plan (backend_engine/accel/plan.py: OPTIONS), e.g. {"prompt": "tiles"}
    block_size: int = 16  # tokens per KV block (a power of two); gateways must use the same
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0  # KV pool size in GiB when num_kv_blocks is None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64  # sequences in one step (the running batch)
    max_num_batched_tokens: int = 512  # the step's token budget, shared by decode tokens and prefill chunks
    long_prefill_token_threshold: int = 0  # 0: a single prefill may take the whole budget
    enable_prefix_caching: bool = True  # automatic prefix caching (`--no-prefix-caching` turns it off)
    eviction_policy: str = "slru"  # "slru" (segmented LRU: reused blocks outlive one-offs) | "lru"
    max_pinned_fraction: float = 0.25  # share of the KV pool that pinned prefixes may hold
    max_waiting: int | None = None  # None: unbounded waiting queue
    target_itl_ms: float | None = None  # step budget for this inter-token latency; None: fixed
    min_prefill_tokens: int = 32  # with target_itl_ms: prefill a step carries at the least
    max_queue_delay_s: float | None = None  # refuse new requests (503) beyond this queue delay
    scheduling_policy: str = "priority"  # "priority" (lower value first) | "fcfs" (arrival only)
    seed: int = 0  # seeds the sampler shared by requests that give no seed
    kv_event_buffer: int = 4096  # events kept for /kv/events replay
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    speculative_method: str | None = None  # None | "ngram" | "draft"
    num_speculative_tokens: int = 4  # k: tokens proposed per sequence and step (1-16)
    ngram_min: int = 2  # shortest suffix the n-gram proposer looks up (1 drafts too often)
    ngram_max: int = 4  # longest suffix tried first
    draft_model: str | None = None  # for "draft": any model sharing the target's tokenizer
    speculative_max_batch: int = 4  # speculate only while this many sequences or fewer run
    tensor_parallel_size: int = 1  # processes (one per device) one replica spans
    # prefill/decode disaggregation (backend_engine/kv_transfer/)
    kv_role: str = "both"  # "both" | "prefill" (sends KV blocks) | "decode" (receives them)
    kv_transfer_host: str = "127.0.0.1"  # decode: where the receiver binds
    kv_transfer_port: int = 0  # decode: the receiver's port (0: any free one)
    kv_transfer_address: str | None = None  # decode: what peers dial (default tcp://host:port)
    kv_transfer_timeout_s: float = 10.0  # silence that fails a transfer; claim hold time
    kv_transfer_chunk_bytes: int = 4 << 20  # prefill: the most block data in one message
    kv_transfer_window: int = 4  # decode: unacknowledged chunks a sender may have in flight

    def validate(self) -> None:
        from backend_engine.accel.plan import plan_for  # torch-free, as this module

        plan_for(self.device, self.engine_options, one_rank=self.tensor_parallel_size == 1,
                 enforce_eager=self.enforce_eager)  # a bad engine option is a PlanError
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be at least 2")
        if self.speculative_method not in (None, "ngram", "draft"):
            raise ValueError("speculative_method must be 'ngram' or 'draft'")
        if self.speculative_method and not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be between 1 and 16")
        if self.speculative_method == "draft" and not self.draft_model:
            raise ValueError("speculative_method 'draft' needs draft_model")
        self.eviction_policy = eviction_policy_name(self.eviction_policy)  # ValueError if unknown
        if not 0.0 <= self.max_pinned_fraction <= 0.9:
            raise ValueError("max_pinned_fraction must be between 0 and 0.9")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}")
        if self.quantization not in (None, "none", "int8", "int4", "awq", "gptq"):
            raise ValueError(f"unsupported quantization {self.quantization!r}; choose none, "
                             "int8, int4, awq or gptq")
        if self.quantization_group_size not in (32, 64, 128):
            raise ValueError("quantization_group_size must be 32, 64 or 128")
        if self.target_itl_ms is not None and self.target_itl_ms <= 0:
            raise ValueError("target_itl_ms must be positive (or None for a fixed budget)")
        if self.min_prefill_tokens < 1:
            raise ValueError("min_prefill_tokens must be at least 1")
        if self.max_queue_delay_s is not None and self.max_queue_delay_s <= 0:
            raise ValueError("max_queue_delay_s must be positive (or None for no bound)")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}")
        if self.kv_role == "decode" and not self.enable_prefix_caching:
            raise ValueError("a decode replica needs prefix caching: imported KV blocks enter "
                             "the prefix cache")
        if self.kv_transfer_timeout_s <= 0 or self.kv_transfer_window < 1 \
                or self.kv_transfer_chunk_bytes < 1 or not 0 <= self.kv_transfer_port <= 65535:
            raise ValueError("kv_transfer_timeout_s, kv_transfer_window and "
                             "kv_transfer_chunk_bytes must be positive, kv_transfer_port a port")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
