"""Speculative decoding (n-gram / prompt lookup) vs none, on the default model.

Workloads: input-grounded (repeat, quote or lightly reformat a paragraph of ~110 tokens, so the
output copies spans of the prompt, as when editing a document or quoting a retrieved passage) and open-ended chat; at concurrency 1 (requests one after another) and 16 (all at
once). Greedy, so both runs produce the same tokens and wall time compares directly.
A draft-model comparison needs a smaller model sharing SmolLM2's tokenizer; none ships with
kvgate, so it runs only with --draft-model PATH. Ends with one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import time

from backend_engine.chat import render_chat
from backend_engine.llm import LLM
from backend_engine.sampling_params import SamplingParams
from benchmarks import results_file

PASSAGES = [
    "The harbour town woke slowly. Fishing boats came back before sunrise, gulls followed them "
    "in wide circles, and the market stalls opened one by one along the stone quay. By seven the "
    "smell of bread and coffee drifted from the bakery on the corner, where the owner stacked "
    "warm loaves in the window and chalked the day's prices on a small board. Children ran past "
    "on their way to school, and the old ferry sounded its horn twice before leaving for the island.",
    "To reset the router, hold the small button on the back for ten seconds until the light "
    "turns orange, then wait two minutes and connect again using the password on the label. If "
    "the light stays red, unplug the power cable, wait thirty seconds and plug it back in. When "
    "the light turns green, open a browser, go to the setup page, and choose a new network name "
    "and password. Write them down and keep them somewhere safe, because the reset erases the "
    "old settings.",
    "Our quarterly report shows revenue grew by twelve percent, mostly from the new subscription "
    "plan, while costs stayed flat because the data centre move finished on schedule. Customer "
    "numbers rose in every region except the north, where a competitor cut prices in the spring. "
    "The board approved a hiring plan for the support team and a second product launch in the "
    "autumn. Cash reserves remain strong, and we expect the next quarter to follow the same trend.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in "
    "the chloroplasts of plant cells, where chlorophyll absorbs mostly red and blue light. The "
    "energy captured from light splits water molecules, releasing oxygen into the air. The plant "
    "then uses that energy to build sugar from carbon dioxide, storing it for growth and for the "
    "night, when no light is available. Almost all life on Earth depends on this process.",
]
TASKS = ["Repeat the following text exactly, word for word:\n\n{}",
         "Copy this text and put it in quotation marks:\n\n{}",
         "Rewrite this text with every sentence on its own line, changing nothing else:\n\n{}",
         "Repeat the text below twice:\n\n{}"]
QUESTIONS = ["What are three good habits for learning a new language?",
             "Write a short story about a robot who wants to paint.",
             "Explain why the sky is blue to a ten-year-old.",
             "Give me ideas for a birthday party in the park."]


def conversations(kind: str, count: int) -> list[list[dict]]:
    if kind == "grounded":
        texts = [TASKS[i % len(TASKS)].format(PASSAGES[i % len(PASSAGES)]) for i in range(count)]
    else:
        texts = [QUESTIONS[i % len(QUESTIONS)] for i in range(count)]
    return [[{"role": "user", "content": t}] for t in texts]


def timed(llm: LLM, prompts: list[list[int]], concurrency: int, params) -> float:
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        llm.generate(prompts[i:i + concurrency], params)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=8, help="speculative tokens per step (8 beat 4 here)")
    ap.add_argument("--c1-requests", type=int, default=4)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=2,
                    help="alternate the engines this many times and keep each one's best time "
                         "(the machine is shared: one slow round should not decide)")
    args = ap.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    common = dict(num_kv_blocks=1024, max_num_seqs=16, dtype=args.dtype)
    engines = {"off": LLM("default", **common),
               "ngram": LLM("default", speculative_method="ngram",
                            num_speculative_tokens=args.k, **common)}
    if args.draft_model:
        engines["draft"] = LLM("default", speculative_method="draft",
                               draft_model=args.draft_model, num_speculative_tokens=args.k,
                               **common)
    tok = engines["off"].tokenizer
    for llm in engines.values():  # warm-up
        llm.generate("Hello", SamplingParams(max_tokens=4))
    result: dict[str, float] = {}
    for kind in ("grounded", "chat"):
        for concurrency in (1, 16):
            count = args.c1_requests if concurrency == 1 else 16
            prompts = [render_chat(tok, c) for c in conversations(kind, count)]
            times: dict[str, float] = {}
            drafted = dict.fromkeys(engines, 0)
            accepted = dict.fromkeys(engines, 0)
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    spec = llm.engine.spec.stats if llm.engine.spec else None
                    d0, a0 = (spec.drafted_tokens, spec.accepted_tokens) if spec else (0, 0)
                    elapsed = timed(llm, prompts, concurrency, params)
                    times[name] = min(times.get(name, elapsed), elapsed)
                    if spec:
                        drafted[name] += spec.drafted_tokens - d0
                        accepted[name] += spec.accepted_tokens - a0
            for name in engines:
                rate = accepted[name] / drafted[name] if drafted[name] else 0.0
                print(f"{kind:8s} c{concurrency:<2d} {name:5s} {times[name]:6.1f}s  "
                      f"drafted {drafted[name]:5d}  acceptance {rate:.2f}")
                if name == "ngram" and kind == "grounded" and concurrency == 1:
                    result["acceptance_grounded"] = round(rate, 3)
            for name in engines:
                if name != "off":
                    key = f"{kind}_speedup_c{concurrency}" + ("" if name == "ngram" else "_draft")
                    result[key] = round(times["off"] / times[name], 3)
    ordered = {k: result[k] for k in ("grounded_speedup_c1", "chat_speedup_c1",
                                      "grounded_speedup_c16", "acceptance_grounded")}
    ordered.update({k: v for k, v in result.items() if k not in ordered})
    ordered["dtype"] = args.dtype
    print(json.dumps(ordered))
    results_file.write("spec_decode", ordered, {"args": vars(args)},
                       name="spec_decode" if args.dtype == "float32" else f"spec_decode_{args.dtype}")


if __name__ == "__main__":
    main()
