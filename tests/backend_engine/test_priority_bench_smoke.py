"""benchmarks/priority.py on the tiny random model: both runs complete every interactive
request, the flood produces tokens, and priority scheduling cuts the interactive tail."""

import asyncio

from benchmarks.priority import parser, percentile, run


def test_priority_benchmark_runs_and_priority_cuts_the_interactive_tail():
    args = parser().parse_args([
        "--model", "tiny-random", "--max-num-seqs", "2", "--batch-streams", "6",
        "--batch-output-tokens", "48", "--interactive", "4", "--interval", "0.1",
        "--warmup", "0.5", "--num-kv-blocks", "128", "--enforce-eager"])
    fcfs, prio = (asyncio.run(run(policy, args)) for policy in ("fcfs", "priority"))
    for r in (fcfs, prio):
        assert len(r.interactive_ttft_s) == 4
        assert r.batch_tokens > 0 and r.window_s > 0
    assert fcfs.preemptions == 0 and prio.preemptions > 0
    assert percentile(prio.interactive_ttft_s, 0.99) < percentile(fcfs.interactive_ttft_s, 0.99)
