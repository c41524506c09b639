"""Structured outputs (json_schema) vs unconstrained generation on the same prompts, default
model, at concurrency 1 (requests one after another) and 16 (16 sequences batched), plus the time
to compile the grammar of a 20-property schema.

Both runs use the same engine settings and chat prompts ("describe item i as JSON"); the
constrained run decodes under the schema's grammar (bitmask filled while the forward pass runs)
until the JSON is complete, then the free run decodes each request (ignore_eos) to exactly as many
tokens as its constrained answer had, so both do the same work but for the grammar. Throughput is
generated tokens per second of wall time over the whole batch (prefills included, the same for
both), best of --repeats runs each, the two modes interleaved. Each row also gives the mean
tokens a schema answer takes under the default whitespace policy (compact JSON) and under the
policy before it (any 16 whitespace characters between JSON tokens, its grammar sent as EBNF),
and how many of those answers finished before --max-tokens. Ends with one line of JSON:
json_schema_ratio_c1, json_schema_ratio_c16 (constrained / free), compile_ms,
mean_tokens_compact and mean_tokens_old_whitespace (c=16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from backend_engine.chat import render_chat
from backend_engine.llm import LLM
from backend_engine.sampling_params import SamplingParams
from backend_engine.structured import StructuredOutputsParams
from benchmarks import results_file

KINDS = ["string", "integer", "boolean", "number", "enum"]


def schema_with(num_properties: int) -> dict:
    """An object of `num_properties` required properties of mixed types (a product record)."""
    props = {}
    for i in range(num_properties):
        kind = KINDS[i % len(KINDS)]
        if kind == "enum":
            props[f"field_{i}"] = {"enum": ["low", "medium", "high"]}
        elif kind == "string":
            props[f"field_{i}"] = {"type": "string", "maxLength": 24}
        else:
            props[f"field_{i}"] = {"type": kind}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def prompts(llm: LLM, count: int, schema: dict) -> list[list[int]]:
    fields = ", ".join(schema["properties"])
    return [render_chat(llm.tokenizer, [{"role": "user", "content":
                        f"Describe product number {i} as a JSON object with the fields {fields}."}])
            for i in range(count)]


def old_whitespace(schema: dict) -> StructuredOutputsParams:
    """The schema under the whitespace policy kvgate had before compact JSON: any whitespace
    character, up to 16 in a row, between any two JSON tokens."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True,
                                           max_whitespace_cnt=16, strict_mode=True)
    return StructuredOutputsParams(grammar=str(grammar))


def throughput(llm: LLM, batch: list[list[int]], params) -> tuple[float, list[int]]:  # noqa: ANN001
    """(generated tokens per second, output tokens of each request)."""
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    produced = [len(o.outputs[0].token_ids) for o in outs]
    return sum(produced) / elapsed, produced


def compare(model: str, concurrency: int, count: int, max_tokens: int, repeats: int,
            schema: dict) -> dict:
    llm = LLM(model, max_num_seqs=concurrency, max_num_batched_tokens=512, num_kv_blocks=2048)
    batch = prompts(llm, count, schema)
    constrained = SamplingParams(temperature=0, max_tokens=max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    llm.generate(batch[:2], constrained)  # warm-up: compile (cached after) and first steps
    llm.generate(batch[:2], SamplingParams(max_tokens=4))
    llm.engine.stats.drain_observations()
    runs: dict[str, list[float]] = {"free": [], "json_schema": []}
    lengths: list[int] = []
    for _ in range(repeats):
        tok_s, lengths = throughput(llm, batch, constrained)
        runs["json_schema"].append(tok_s)
        free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        runs["free"].append(throughput(llm, batch, free)[0])
    masks = llm.engine.stats.drain_observations()["grammar_mask"]
    old = llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens,
                                             structured_outputs=old_whitespace(schema)))
    old_lengths = [len(o.outputs[0].token_ids) for o in old]
    row = {"concurrency": concurrency, "requests": count,
           "free_tok_s": round(max(runs["free"]), 1),
           "json_schema_tok_s": round(max(runs["json_schema"]), 1),
           "mean_tokens": round(statistics.mean(lengths), 1),
           "mean_tokens_old_whitespace": round(statistics.mean(old_lengths), 1),
           "finished_old_whitespace": sum(o.outputs[0].finish_reason == "stop" for o in old),
           "mask_fill_ms_per_step": round(1000 * statistics.mean(masks), 3) if masks else None}
    row["ratio"] = round(row["json_schema_tok_s"] / row["free_tok_s"], 3)
    llm.engine.structured.shutdown()
    return row


def compile_ms(model: str, schema: dict, runs: int = 5) -> tuple[float, float]:
    """(first compile, including the tokenizer tables; median of later fresh compiles), in ms."""
    import xgrammar as xgr

    from backend_engine.structured.compiler import grammar_of

    llm = LLM(model, num_kv_blocks=64)
    manager = llm.engine.structured
    params = StructuredOutputsParams(json=schema)
    start = time.perf_counter()
    compiler = xgr.GrammarCompiler(manager._tokenizer_info(), max_threads=1, cache_enabled=False)
    compiler.compile_grammar(grammar_of(params))
    first = 1000 * (time.perf_counter() - start)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        compiler.compile_grammar(grammar_of(params))
        times.append(1000 * (time.perf_counter() - start))
    return first, statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--properties", type=int, default=20, help="schema size (compile time)")
    parser.add_argument("--throughput-properties", type=int, default=6,
                        help="schema size for the throughput runs")
    parser.add_argument("--requests-c1", type=int, default=4)
    parser.add_argument("--requests-c16", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    first, median = compile_ms(args.model, schema_with(args.properties))
    print(f"compile, {args.properties}-property schema: {median:.1f} ms "
          f"(first, with the tokenizer tables: {first:.0f} ms)", flush=True)
    schema = schema_with(args.throughput_properties)
    rows = []
    for concurrency, count in ((1, args.requests_c1), (16, args.requests_c16)):
        row = compare(args.model, concurrency, count, args.max_tokens, args.repeats, schema)
        rows.append(row)
        print(f"c={concurrency:<2} free {row['free_tok_s']:7.1f} tok/s   json_schema "
              f"{row['json_schema_tok_s']:7.1f} tok/s   ratio {row['ratio']:.3f}   mask fill "
              f"{row['mask_fill_ms_per_step']} ms/step", flush=True)
        print(f"     mean tokens of a schema answer: compact (default) {row['mean_tokens']}, old "
              f"whitespace {row['mean_tokens_old_whitespace']} ({row['finished_old_whitespace']}"
              f"/{count} finished within {args.max_tokens})", flush=True)
    summary = {"json_schema_ratio_c1": rows[0]["ratio"], "json_schema_ratio_c16": rows[1]["ratio"],
               "compile_ms": round(median, 2), "first_compile_ms": round(first, 1),
               "mean_tokens_compact": rows[1]["mean_tokens"],
               "mean_tokens_old_whitespace": rows[1]["mean_tokens_old_whitespace"], "runs": rows}
    print(json.dumps(summary))
    results_file.write("structured_output", summary, {"args": vars(args)}, argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
