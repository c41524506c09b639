"""The rows of the README's headline table: for each results file, what is compared with what
(both sides, with their weights and dtype where a model runs) and which of its summary figures
show. The wording lives here, in reviewed code; results files hold only figures and arguments.

`compared` and each figure are `str.format` templates over the file's summary, plus `args` (the
benchmark's arguments) and `results` (or, where the wording depends on them, a function of the
file). A figure whose fields the file lacks is left out; a file that lacks the fields of
`compared` or of the row's first figure gets no row (a run without the baseline it is
headlined against)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from backend_engine.dtype import resolve_dtype

SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
LLAMACPP = "llama.cpp `llama-server` (the GGUF's {gguf} weights as stored, {slots} slots)"
# the GGUF each model name serves, as llama.cpp reads it
GGUF_TYPES = {"default": "Q4_1", "gemma3-270m": "Q4_K_M"}


@dataclass(frozen=True)
class Row:
    benchmark: str
    compared: str | Callable[[dict], str]  # both sides of the comparison
    figures: tuple[str, ...]
    file: str = ""  # the results file's stem; the benchmark's name when empty
    like_for_like: str = ""  # where the sides' weights differ: the file holding the like-for-like figure

    @property
    def stem(self) -> str:
        return self.file or self.benchmark


def args(doc: dict) -> dict:
    return doc["results"].get("args") or {}


def engine_dtype(requested: str | None) -> str:
    """The dtype a CPU replica computes in: `auto` resolves as backend_engine.dtype does."""
    resolved = resolve_dtype(requested or "auto", "cpu")
    return SHORT_DTYPE.get(resolved, resolved)


def kvgate_weights(quantization: str | None, dtype: str) -> str:
    return f"{quantization} weights, {dtype} compute" if quantization else f"{dtype} weights"


def trace_load(doc: dict) -> str:
    a, engine = args(doc), doc["results"].get("engine") or {}
    model = a.get("model", "default")
    gguf = GGUF_TYPES.get(model, "Q4_1")
    quant = engine.get("quantization")
    as_stored = quant is None and model in GGUF_TYPES  # a GGUF is served in its stored format
    if as_stored and gguf == "Q4_1":
        quant, as_stored = "int4", False
    dtype = engine_dtype(engine.get("dtype"))
    split = "".join(f", {v} {k}" for k, v in (("replicas", a.get("replicas")),
                                              ("threads each", a.get("threads"))) if v)
    weights = (f"the {gguf} GGUF as stored, {dtype} compute" if as_stored
               else kvgate_weights(quant, dtype))
    name = "" if model == "default" else f" {model}"
    sides = (f"a burst of {a.get('rows')} Mooncake-trace chats ({a.get('speedup')}x speed), same cores: "
             f"kvgate up{name} ({weights}{split}) vs "
             + LLAMACPP.format(gguf=gguf, slots=a.get("llamacpp_parallel")))
    if quant == "int4" and gguf == "Q4_1":
        return sides + "; both 4-bit in 32-weight groups with a scale and a minimum"
    if as_stored:
        return sides + ("; the same file on both sides (kvgate: Q4_K as int4 groups of 32; Q5_0, "
                        "Q6_K and Q8_0 as int8 per channel)")
    if quant:
        return sides + f"; the weights differ ({quant} vs {gguf})"
    return sides + f"; the weights differ (that {gguf} dequantised to {dtype} vs {gguf} as stored)"


def engine_throughput(doc: dict) -> str:
    a = args(doc)
    dtype = SHORT_DTYPE.get(a.get("dtype"), a.get("dtype"))
    sides = (f"{a.get('requests')} requests of {a.get('prompt_tokens')} + {a.get('new_tokens')} tokens: "
             f"kvgate engine ({kvgate_weights(a.get('quantization'), dtype)}, {a.get('concurrency')} at once) "
             f"vs transformers ({dtype} weights) `generate` one request at a time and `generate_batch` "
             f"{a.get('concurrency')} at once")
    if a.get("quantization"):
        return sides + f"; the weights differ ({a['quantization']} vs {dtype})"
    return sides


FINISHED = "finished {kvgate_finished}/{requests} vs {llamacpp_finished}/{requests}"
TRACE_FIGURES = ("out tok/s ×{out_tok_s_vs_llamacpp}", FINISHED, "TTFT p99 ×{ttft_p99_vs_llamacpp}",
                 "ITL p99 ×{itl_p99_vs_llamacpp}", "goodput {kvgate_goodput} vs {llamacpp_goodput}")
ENGINE_FIGURES = ("×{speedup_vs_hf} `generate`", "×{speedup_vs_hf_cb} `generate_batch`",
                  "kvgate {kvgate_tok_s} tok/s")
SERVE_FIGURES = ("TTFT p50 ×{ttft_p50_vs_round_robin}", "throughput ×{throughput_vs_round_robin}",
                 "cached ratio {cached_ratio}", "2 gateways + Redis vs 1: cached ratio ×{cached_ratio_2gw_over_1gw}")
SPEC_FIGURES = ("grounded c=1 ×{grounded_speedup_c1}", "chat c=1 ×{chat_speedup_c1}",
                "grounded c=16 ×{grounded_speedup_c16}", "acceptance {acceptance_grounded}")


def kv_tier(doc: dict) -> str:
    a, r = args(doc), doc["results"]
    eager = ", eager: no compiled graphs" if a.get("enforce_eager") else ""
    return (f"{a['sessions']} multi-turn chat sessions ({a['model']} model{eager}) whose working "
            f"set is {r['working_set_blocks']} blocks, {a['working_set_ratio']:g}x the "
            f"{r['pool_blocks']}-block KV pool: a host-memory KV tier vs none, same engine")


def spec_decode(doc: dict) -> str:
    a = args(doc)
    return (f"kvgate engine ({SHORT_DTYPE.get(a.get('dtype'), a.get('dtype'))} weights), greedy: "
            f"n-gram speculation (k = {a.get('k')}) vs none, same engine")


ROWS: tuple[Row, ...] = (
    Row("trace_load", trace_load, TRACE_FIGURES),
    Row("trace_load", trace_load, TRACE_FIGURES, file="trace_load_int4"),
    Row("trace_load", trace_load, TRACE_FIGURES, file="trace_load_gemma3-270m"),
    Row("vs_smg", "{args[rows]} chats of whole Mooncake-trace conversations and {args[rows]} business chats "
        "(shared system prompts and documents) on {args[replicas]} fresh kvgate replicas per turn: "
        "kvgate's gateway (prefix_cost, no tokenizer flag) vs SGLang's `smg` (cache_aware), worst of "
        "the two workloads",
        ("TTFT p50 ×{ttft_p50_vs_smg}", "TTFT p99 ×{ttft_p99_vs_smg}",
         "cached-token ratio {cached_ratio_minus_smg:+} over smg's",
         "kvgate / smg / ceiling: Mooncake {results[runs][mooncake][kvgate][cached_ratio]} / "
         "{results[runs][mooncake][smg][cached_ratio]} / {cached_ceiling[mooncake]}, business "
         "{results[runs][business][kvgate][cached_ratio]} / {results[runs][business][smg][cached_ratio]} / "
         "{cached_ceiling[business]}",
         "finished {kvgate_finished}/{requests} vs {smg_finished}/{requests}")),
    Row("serve_bench", "{results[replicas]} live CPU replicas of the default model, the same engine and "
        "weights under every policy, multi-tenant workload: kvgate routing vs round robin, 1 gateway",
        SERVE_FIGURES),
    Row("routing_sim", "{args[replicas]} simulated replicas driving the real router, multi-tenant system "
        "prompts: the prefix_cost policy vs round robin and vs one pooled cache (the bound)",
        ("hit rate {hit_vs_upper} of the bound", "×{hit_vs_round_robin} round robin's",
         "TTFT p50 ×{ttft_p50_vs_round_robin}", "busy max/mean {load_max_over_mean}",
         "4 gateways sharing state vs 1: hit ×{hit_4gw_over_1gw}",
         "no reuse: TTFT p50 ×{noreuse_ttft_vs_least_load} least load's",
         "short-prefix sessions, approximate index, 2 gateways without shared state: hit "
         "{hints_hit_approx_2gw} with routing hints vs {no_hints_hit_approx_2gw} without "
         "(exact index: {hints_hit_exact} vs {no_hints_hit_exact})")),
    Row("routing_sim", "{args[replicas]} simulated replicas publishing vLLM-format ZMQ KV events vs kvgate's "
        "own events (prefix_cost policy); no events at all (the approximate index) beside",
        ("hit rate ×{zmq_hit_vs_native} native events'", "approximate index ×{approximate_hit_vs_native}",
         "{ingest_blocks_per_s} blocks/s ingested"), file="routing_sim_foreign"),
    Row("routing_latency", "one routing decision ({results[prompt_tokens]}-token prompt, "
        "{results[replicas]} replicas, prefix_cost policy): in memory and through Redis",
        ("in memory p50 {memory[p50_us]} µs, p99 {memory[p99_us]} µs",
         "Redis p50 {redis[p50_us]} µs, p99 {redis[p99_us]} µs")),
    Row("gateway_overhead", "a fixture upstream (fixed answers, no model) through the gateway vs called "
        "directly, {args[rate]:g} req/s open loop",
        ("added p50 {added_p50_ms} ms", "added p99 {added_p99_ms} ms",
         "{max_rps} req/s through the gateway (closed loop)")),
    Row("prefix_cache", "kvgate engine (fp32 weights), {args[requests]} prompts of ~{args[prompt_tokens]} "
        "tokens sharing a system prompt: prefix cache on vs off",
        ("median TTFT ×{ttft_ratio_60} (60 % shared)", "×{ttft_ratio_80} (80 % shared)")),
    Row("chunked_prefill", "kvgate engine (fp32 weights), decodes while {args[long_tokens]}-token prompts "
        "arrive: {args[chunk]}-token prefill chunks vs whole prompts",
        ("p99 inter-token latency ×{p99_itl_ratio}", "throughput ×{throughput_ratio}")),
    Row("engine_throughput", engine_throughput, ENGINE_FIGURES),
    Row("engine_throughput", engine_throughput, ENGINE_FIGURES, file="engine_throughput_bfloat16"),
    Row("engine_throughput", engine_throughput, ENGINE_FIGURES, file="engine_throughput_int8",
        like_for_like="engine_throughput"),
    Row("spec_decode", spec_decode, SPEC_FIGURES),
    Row("spec_decode", spec_decode, SPEC_FIGURES, file="spec_decode_bfloat16"),
    Row("quant_quality", "kvgate engine, int8 and int4 (32-weight groups) weights vs fp32 (the GGUF "
        "dequantised): perplexity on a fixed text, greedy agreement",
        ("int8 perplexity ×{int8_ppl_ratio}, agreement {int8_greedy_agreement}",
         "int4 perplexity ×{int4_ppl_ratio}, agreement {int4_greedy_agreement}")),
    Row("quant_speed", "a kvgate replica with int4 weights (32-weight groups, bf16 compute) vs "
        + LLAMACPP.format(gguf="Q4_1", slots="{args[concurrency]}") + ", both 4-bit, {args[threads]} threads each, "
        "measured in turns",
        ("decode tok/s c=1 ×{int4_c1_vs_llamacpp}", "c=16 ×{int4_c16_vs_llamacpp}")),
    Row("priority", "kvgate engine, interactive requests arriving in a batch flood: priority vs FCFS "
        "scheduling",
        ("interactive TTFT p99 ×{interactive_ttft_p99_ratio} ({interactive_ttft_p99_ms[priority]} vs "
         "{interactive_ttft_p99_ms[fcfs]} ms)", "batch throughput ×{batch_throughput_ratio}")),
    Row("eviction", "{args[requests]} requests on a {args[kv_blocks]}-block KV pool ({args[model]} "
        "model): SLRU eviction with a pinned prefix vs plain LRU",
        ("pinned prefix hit rate {valuable_prefix_hit_slru_pin} vs {valuable_prefix_hit_lru}",
         "overall hit rate ×{overall_hit_ratio_vs_lru}")),
    Row("kv_tier", kv_tier,
        ("TTFT p50 ×{ttft_p50_ratio} (a pool holding the whole working set: ×{ttft_p50_ratio_big_pool})",
         "restore {restore_vs_prefill_speed}x faster per token than "
         "prefill", "prefill tokens saved {prefill_tokens_saved_share:.0%}", "TTFT p99 ×{ttft_p99_ratio}",
         "disk tier TTFT p50 ×{ttft_p50_ratio_disk}",
         "answers as with pool hits {answers_identical_to_pool_hits}")),
    Row("structured_output", "kvgate engine ({args[model]} model), JSON-schema-constrained vs free "
        "decoding, same engine and weights",
        ("tok/s ×{json_schema_ratio_c1} at c=1", "×{json_schema_ratio_c16} at c=16",
         "{args[properties]}-property schema compiled in {compile_ms} ms")),
    Row("tensor_parallel", "the {model} model on {device}, same fp32 weights: tensor parallelism over 2 "
        "ranks (gloo on CPU) vs 1",
        ("decode step, 8 sequences: {tp2[decode_8][step_ms]} vs {tp1[decode_8][step_ms]} ms",
         "{tp2[decode_8][collectives]} collectives a step", "same tokens: {tp2[tokens_match]}")),
    Row("pd_disagg", "{args[model]} model, 2 replicas: prefill and decode on separate replicas vs "
        "colocated, same requests",
        ("decode ITL p99 ×{itl_p99_ratio}", "throughput ×{throughput_ratio}", "TTFT p99 ×{ttft_p99_ratio}",
         "goodput ×{goodput_ratio}")),
    Row("reliability_report", "local clusters of tiny-model replicas under replica and state faults, bad "
        "input, schema fuzzing and a {results[soak_s]:.0f}-s soak: pass or fail, no baseline",
        ("{requests_lost} requests lost", "{scenarios_passed} of {scenarios_total} scenarios passed",
         "fuzzing 5xx {fuzz_5xx}", "soak RSS growth {rss_growth_mb} MB")),
    Row("gpu_check", "one GPU: kvgate's Triton kernels natively, their bandwidth vs the GPU's peak, "
        "the engine on CUDA vs CPU on the same weights (greedy)",
        ("decode attention at {decode_attn_bw_fraction} of peak bandwidth",
         "CUDA tokens identical to CPU's: {engine_tokens_identical}",
         "kernel tests passed: {kernel_tests_passed}")),
)

# Benchmarks that write results files but measure a part behind a headline row; their pages
# in docs/benchmarks/ link to their files. (The README stays a short page.)
NOT_HEADLINED = {
    "server_overhead": "the HTTP server's cost over the offline engine (engine page)",
    "prefix_advice": "the cost of the gateway's prefix-stability check (gateway page)",
    "prompt_tokens": "the routing tier's chat tokenisation, whole text vs by pieces (gateway page)",
    "envoy_picker": "Envoy + kvgate picker against the gateway as the routing tier (behind-Envoy page)",
    "decode_attention": "decode attention forms against each other (engine page)",
    "mixed_step": "one mixed step against its matmuls (engine page)",
    "decode_step": "one decode step with KV cache groups sharing pools and with a pool per "
                   "layer (engine page)",
    "moe_experts": "one MoE layer's expert forms against each other (engine page)",
    "sliding_window_memory": "KV bytes, not speed: a sliding-window model's KV cache groups "
                             "(prefix-caching page, README family table)",
    "long_prompts": "the engine's prefill and decode speed on long prompts, per plan variant "
                    "(quantisation page)",
    "quant_prompt_rows": "prompt-row forms of quantised weights, per layer (quantisation page)",
    "kv_transfer_transport": "which library carries KV blocks (P/D page)",
    "decode_bandwidth": "a stage of gpu_check",
    "quant_bandwidth": "a stage of gpu_check",
    "gpu_engine_check": "a stage of gpu_check",
    "gpu_engine_vs_hf": "the engine vs transformers on one GPU, apart from gpu_check (engine page)",
}
