"""The two prefix-sharing workloads of `benchmarks.vs_smg`, as chat requests (text, so SGLang's
model gateway, whose cache-aware policy matches request text, and kvgate's, which matches token
blocks, see the same thing):

- `mooncake`: whole conversations of the public Mooncake conversation trace, in the order they
  open, every turn at the trace's time (benchmarks/trace_load_workload.py: each hash id a block
  of 16 single-token words, so a later turn repeats its conversation's earlier prompt);
- `business`: a few applications, each with its system prompt and a handful of documents
  (contracts, manuals, tickets); each request is one application's system prompt, one of its
  documents and a short question, with Zipf-skewed popularity and Poisson arrivals. The
  documents a run touches take more KV blocks than one replica holds (384 blocks of 16) and fewer
  than two do, so the replica a request goes to decides whether its document is still cached."""

from __future__ import annotations

import random

from benchmarks.serve_bench_workloads import Job, RequestSpec
from benchmarks.trace_load_workload import trace_jobs, trace_path

WORKLOADS = ("mooncake", "business")


def _text(rng: random.Random, words: list[str], n: int) -> str:
    return " ".join(rng.choice(words) for _ in range(n))


def business_jobs(rows: int, rate: float, words: list[str], output_tokens: int, seed: int = 0,
                  apps: int = 4, docs_per_app: int = 8, system_words: int = 160,
                  doc_words: int = 448, question_words: int = 16) -> list[Job]:
    rng = random.Random(seed)
    systems = [f"You are the assistant of application {a}. " + _text(rng, words, system_words)
               for a in range(apps)]
    docs = [[f"Document {a}.{d}: " + _text(rng, words, doc_words) for d in range(docs_per_app)]
            for a in range(apps)]
    app_weights = [1 / (a + 1) ** 0.6 for a in range(apps)]
    doc_weights = [1 / (d + 1) ** 0.8 for d in range(docs_per_app)]
    jobs, t = [], 0.0
    for _ in range(rows):
        t += rng.expovariate(rate)
        a = rng.choices(range(apps), app_weights)[0]
        d = rng.choices(range(docs_per_app), doc_weights)[0]
        prompt = (f"{systems[a]}\n\n{docs[a][d]}\n\nQuestion: "
                  f"{_text(rng, words, question_words)}?")
        jobs.append(Job([[RequestSpec(prompt, output_tokens, f"app{a}-doc{d}")]], t))
    return jobs


def build(name: str, rows: int, words: list[str], output_tokens: int, speedup: float,
          rate: float, max_input_tokens: int) -> list[Job]:
    if name == "mooncake":
        return trace_jobs(trace_path("conversation"), rows, speedup, words,
                          max_output_tokens=output_tokens, max_input_tokens=max_input_tokens,
                          conversations=True)
    if name == "business":
        return business_jobs(rows, rate, words, output_tokens)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
