"""Quality of quantised weights against fp32, on the default model (SmolLM2-135M-Instruct) or
another GGUF checkpoint (`--model gemma3-270m`).

Per format: perplexity on a fixed public-domain text shipped with the tests (~3,200 tokens,
tests/backend_engine/quant/data/evaluation_text.txt, full context, chunked prefill), and greedy
agreement over 32 prompts x 64 new tokens against fp32, two ways:
- `agreement`: teacher-forced top-1 agreement, i.e. at each of fp32's 64 greedy tokens, does the
  format's argmax (given fp32's tokens so far) pick the same token; no cascade after a miss;
- `prefix`: free-running generation, the share of the 64 tokens before the first difference.

Formats: fp32 (the reference: the GGUF's Q4_1 weights dequantised), bf16, int8 and int4
(quantised at load from those fp32 weights, group 32 (the default) and 64; SmolLM2's 576 input
features rule out 128), and `gguf-int4`, the GGUF's own 4-bit tensors loaded as stored (by
construction the reference's values, so its ratio measures only the kernels' bf16 activations
and the lm_head). The lm_head is the plan's for this CPU (w8a8, int8 weights times int8
activations per row, on every CPU class); `-lm8` rows take
`--engine-option lm_head=int8` (weight-only), `int4-lm4` takes `int4`. `transformers` is
transformers' own implementation loading the same GGUF (`gguf_file=`, dequantised to fp32): the
same values as fp32, computed by the other implementation, so its ratio says how far kvgate's
fp32 answers are from transformers' on the real checkpoint. Ends with one line of JSON with the
ppl ratios and greedy agreements of int8, int4, transformers and those rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from pathlib import Path

import torch

from backend_engine.attention.metadata import AttentionMetadata, PrefillChunk
from backend_engine.llm import LLM
from backend_engine.model_loader import gguf_file, resolve_model
from backend_engine.accel.cpu import template as cpu_template
from backend_engine.accel.cpu import tiles as cpu_tiles
from backend_engine.sampling_params import SamplingParams
from benchmarks import results_file

TEXT = Path(__file__).resolve().parent.parent / "tests/backend_engine/quant/data/evaluation_text.txt"
CHUNK = 512
NUM_PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 32, 24, 64


def formats(model: str = "default") -> dict[str, dict]:
    fp = str(resolve_model(model).folder)  # the dequantised fp32 checkpoint
    return {"fp32": dict(model=model, quantization="none", dtype="float32"),
            "transformers": dict(model=model),  # not an engine: transformers on the GGUF
            "bf16": dict(model=model, quantization="none", dtype="bfloat16"),
            "int8": dict(model=fp, quantization="int8"),
            "int4": dict(model=fp, quantization="int4", quantization_group_size=32),
            "int4-g64": dict(model=fp, quantization="int4", quantization_group_size=64),
            "int4-lm4": dict(model=fp, quantization="int4", engine_options={"lm_head": "int4"}),
            "int8-lm8": dict(model=fp, quantization="int8", engine_options={"lm_head": "int8"}),
            "int4-lm8": dict(model=fp, quantization="int4", engine_options={"lm_head": "int8"}),
            "gguf-int4": dict(model=model, quantization="int4")}


def _forward_logprobs(runner, ids: list[int]):
    """Log-probabilities [chunk, vocab] of each next token, chunk by chunk (start, logprobs): the
    text fed in chunks of CHUNK tokens over a paged cache (one block per 16 tokens), through the
    runner's planned forward pass (every row a prompt row, in the plan's prompt form). Chunked,
    so a 262k-token vocabulary (Gemma 3) never holds the whole text's logits."""
    model, forward = runner.model, runner.forward_pass
    n, block = len(ids), 16
    shape = (-(-n // block), block, model.num_kv_heads, model.head_dim)
    dtype = model.embed.dtype
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
              for _ in range(model.num_layers)]
    for start in range(0, n, CHUNK):
        end = min(n, start + CHUNK)
        slots = torch.arange(start, end)
        meta = AttentionMetadata(slot_mapping=slots, prefills=[
            PrefillChunk(0, end - start, end, torch.arange(-(-end // block)))])
        hidden = forward(torch.tensor(ids[start:end]), slots, caches, meta)
        yield start, torch.log_softmax(forward.compute_logits(hidden), dim=-1)


class TransformersScorer:
    """transformers' own implementation on the checkpoint's GGUF, scored as the engine is: the
    whole text in one forward pass, the vocabulary's log-probabilities CHUNK rows at a time."""

    def __init__(self, gguf: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()

    def logprobs(self, ids: list[int]):
        hidden = self.model.model(torch.tensor([ids])).last_hidden_state[0]
        for start in range(0, len(ids), CHUNK):
            logits = self.model.lm_head(hidden[start:start + CHUNK]).float()
            yield start, torch.log_softmax(logits, dim=-1)

    def generate(self, prompt_list: list[list[int]], new_tokens: int) -> list[list[int]]:
        outs = []
        for prompt in prompt_list:
            seq = self.model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False)
            outs.append(seq[0, len(prompt):].tolist())
        return outs


def _scored(source, ids: list[int]):
    if isinstance(source, TransformersScorer):
        return source.logprobs(ids)
    return _forward_logprobs(source, ids)


def perplexity(source, ids: list[int]) -> float:
    """exp(mean NLL of each token given those before it); source: an engine's runner, or a
    TransformersScorer."""
    target = torch.tensor(ids[1:])
    nll = 0.0
    for start, logprobs in _scored(source, ids):
        rows = logprobs[: len(target) - start]  # the last token predicts nothing
        nll -= float(rows.gather(1, target[start:start + len(rows)].unsqueeze(1)).sum())
    return math.exp(nll / len(target))


def prompts(ids: list[int]) -> list[list[int]]:
    """NUM_PROMPTS windows of PROMPT_TOKENS tokens spread over the text."""
    step = (len(ids) - PROMPT_TOKENS) // NUM_PROMPTS
    return [ids[i * step: i * step + PROMPT_TOKENS] for i in range(NUM_PROMPTS)]


def teacher_forced_agreement(source, prompt_list, reference) -> float:
    hits = total = 0
    for prompt, ref in zip(prompt_list, reference):
        seq = prompt + ref
        logprobs = torch.cat([lp for _, lp in _scored(source, seq)])
        picks = logprobs[len(prompt) - 1: len(seq) - 1].argmax(-1)
        hits += int((picks == torch.tensor(ref)).sum())
        total += len(ref)
    return hits / total


def prefix_agreement(outputs, reference) -> float:
    shares = []
    for out, ref in zip(outputs, reference):
        same = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), len(ref))
        shares.append(same / len(ref))
    return sum(shares) / len(shares)


def evaluate_transformers(gguf: Path, ids: list[int], prompt_list, reference) -> dict:
    start = time.perf_counter()
    scorer = TransformersScorer(gguf)
    with torch.inference_mode():
        row = {"format": "transformers", "ppl": perplexity(scorer, ids)}
        outputs = scorer.generate(prompt_list, NEW_TOKENS)
        row["agreement"] = teacher_forced_agreement(scorer, prompt_list, reference)
        row["prefix"] = prefix_agreement(outputs, reference)
    row["weight_mb"] = sum(p.nbytes for p in scorer.model.parameters()) / 1e6
    row["seconds"] = time.perf_counter() - start
    del scorer
    gc.collect()
    return row, outputs


def evaluate(name: str, spec: dict, ids: list[int], prompt_list, reference) -> dict:
    if name == "transformers":
        return evaluate_transformers(gguf_file(spec["model"]), ids, prompt_list, reference)
    start = time.perf_counter()
    llm = LLM(num_kv_blocks=512, **spec)
    runner = llm.engine.runner
    with torch.inference_mode():
        ppl = perplexity(runner, ids)
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompt_list, params)]
        row = {"format": name, "ppl": ppl}
        if reference is not None:
            row["agreement"] = teacher_forced_agreement(runner, prompt_list, reference)
            row["prefix"] = prefix_agreement(outputs, reference)
    row["weight_mb"] = weight_bytes(runner) / 1e6
    row["seconds"] = time.perf_counter() - start
    del llm, runner
    gc.collect()
    return row, outputs


def weight_bytes(runner) -> int:
    """Bytes of every weight the model holds (embeddings, norms, linear layers, lm_head), with
    the copies GEMM templates hold (int4 prompt rows; the int8 template decode step's) and the
    resident dequantised copies of `tiles` prompt rows."""
    model, step = runner.model, runner.forward_pass.decode_step
    seen: dict[int, int] = {}

    def add(w) -> None:
        if w is not None:
            seen[id(w)] = (w.nbytes + cpu_template.extra_bytes(w) + cpu_tiles.extra_bytes(w)
                           if hasattr(w, "nbytes")
                           else w.numel() * w.element_size())

    add(model.embed), add(model.norm), add(model.lm_head)
    for layer in model.layers:
        for name in ("qkv_weight", "qkv_bias", "qk_norm", "o_weight", "gate_up_weight",
                     "down_weight", "input_norm", "post_attn_norm", "pre_ff_norm",
                     "post_ff_norm"):  # (the last two: Gemma 3's)
            add(getattr(layer, name, None))
    return sum(seen.values()) + (step.extra_bytes if step is not None else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default",
                    help='"default" (SmolLM2-135M-Instruct), "gemma3-270m", or a .gguf file')
    ap.add_argument("--formats", default=None,
                    help="comma-separated subset (fp32 is always run first; default: all)")
    args = ap.parse_args()
    torch.manual_seed(0)
    if gguf_file(args.model) is None:
        ap.error(f"--model {args.model!r} is not a GGUF checkpoint: the formats start from one")
    specs = formats(args.model)
    args.formats = args.formats or ",".join(specs)
    unknown = sorted(set(args.formats.split(",")) - set(specs) - {""})
    if unknown:
        ap.error(f"unknown formats {unknown}; known: {', '.join(specs)}")
    wanted = ["fp32"] + [f for f in args.formats.split(",") if f and f != "fp32"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model).folder)
    ids = tokenizer.encode(TEXT.read_text())
    prompt_list = prompts(ids)
    rows, reference = [], None
    for name in wanted:
        row, outputs = evaluate(name, specs[name], ids, prompt_list, reference)
        if reference is None:
            reference, base = outputs, row["ppl"]
        row["ppl_ratio"] = row["ppl"] / base
        rows.append(row)
        print(f"{name:10s} ppl {row['ppl']:.3f} (x{row['ppl_ratio']:.4f})  "
              f"agreement {row.get('agreement', 1.0):.3f}  prefix {row.get('prefix', 1.0):.3f}  "
              f"weights {row['weight_mb']:.0f} MB  ({row['seconds']:.0f} s)", flush=True)
    by = {r["format"]: r for r in rows}
    summary = {"model": args.model, "tokens": len(ids), "rows": rows}
    for fmt in ("int8", "int4", "transformers", "gguf-int4", "int8-lm8", "int4-lm8", "int4-lm4"):
        if fmt in by:
            key = fmt.replace("-", "_")
            summary[f"{key}_ppl_ratio"] = round(by[fmt]["ppl_ratio"], 4)
            summary[f"{key}_greedy_agreement"] = round(by[fmt]["agreement"], 4)
            summary[f"{key}_greedy_prefix"] = round(by[fmt]["prefix"], 4)
    print(json.dumps(summary))
    name = "quant_quality" if args.model == "default" else f"quant_quality_{Path(args.model).stem}"
    results_file.write("quant_quality", summary, {"args": vars(args)}, name=name)


if __name__ == "__main__":
    main()
