"""`kvgate engine --tensor-parallel-size 2` (two gloo processes): the OpenAI server answers
with the tokens of one rank; a worker killed with SIGKILL takes the replica down (the stream in
flight ends with an error, /health answers 503, the server exits 1) and, like SIGTERM, leaves no
process behind, as does a rank 0 killed with SIGKILL; a size the model's heads do not allow is
refused at start-up, saying why."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import torch

from backend_engine.llm import LLM
from backend_engine.sampling_params import SamplingParams
from tests.gateway.procs import ROOT, Proc, free_port

PROMPT = [1, 504, 3287, 282, 4052, 314, 30, 2]
MAX_TOKENS = 12


def tp_replica(*extra: str) -> Proc:
    port = free_port()
    return Proc(["engine", "--model", "tiny-random", "--enforce-eager", "--port", str(port), "--num-kv-blocks", "64",
                 "--num-threads", "1", "--tensor-parallel-size", "2", "--log-level", "info",
                 "--dtype", "float32", *extra],
                port, "/health", "tp-replica")


def descendants(proc: Proc) -> list[psutil.Process]:
    return psutil.Process(proc.proc.pid).children(recursive=True)


def worker_of(proc: Proc) -> psutil.Process:
    workers = [p for p in descendants(proc) if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(workers) == 1, workers
    return workers[0]


def gone(processes: list[psutil.Process], timeout_s: float = 20.0) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return not alive


def complete(url: str, **extra) -> httpx.Response:
    body = {"model": "tiny-random", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 1, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def one_rank():
    before = torch.get_num_threads()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    out = LLM("tiny-random", enforce_eager=True, num_kv_blocks=64, num_threads=1).generate([PROMPT], params)[0]
    torch.set_num_threads(before)
    return out.outputs[0]


@pytest.mark.timeout(240)
def test_server_answers_like_one_rank_and_sigterm_stops_every_process(one_rank):
    replica = tp_replica().start(timeout_s=180)
    try:
        children = descendants(replica)
        assert worker_of(replica)
        resp = complete(replica.url)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["text"] == one_rank.text
        torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]),
                                   torch.tensor([lp.logprob for lp in one_rank.logprobs]),
                                   atol=1e-4, rtol=0)
        replica.proc.send_signal(signal.SIGTERM)
        assert replica.proc.wait(timeout=60) == 0
        assert gone(children)
    finally:
        replica.kill()


@pytest.mark.timeout(240)
def test_a_killed_worker_takes_the_replica_down_and_leaves_no_process():
    replica = tp_replica().start(timeout_s=180)
    try:
        children, worker = descendants(replica), worker_of(replica)
        body = {"model": "tiny-random", "prompt": PROMPT, "max_tokens": 1900, "temperature": 0,
                "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{replica.url}/v1/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) == 2:
                        worker.send_signal(signal.SIGKILL)
        assert "error" in events[-1], events[-1]  # the stream ended early, saying why
        assert events[-1]["error"]["code"] is not None
        health = None
        deadline = time.monotonic() + 30
        while replica.proc.poll() is None and time.monotonic() < deadline:
            try:
                health = httpx.get(f"{replica.url}/health", timeout=2)
            except httpx.HTTPError:
                break
            time.sleep(0.1)
        if health is not None:
            assert health.status_code == 503
            assert "tensor-parallel rank 1" in health.json()["reason"]
        assert replica.proc.wait(timeout=30) == 1  # down, for a supervisor to restart
        assert gone(children)
        assert f"tensor-parallel rank 1 (pid {worker.pid}) was killed by SIGKILL" \
            in replica.log.read_text()
    finally:
        replica.kill()


@pytest.mark.timeout(180)
def test_a_size_the_heads_do_not_allow_is_refused_at_start_up_saying_why():
    refused = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "engine", "--model", "default", "--port", str(free_port()),
         "--tensor-parallel-size", "2", "--log-level", "error"],
        cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert refused.returncode == 1
    assert ("tensor_parallel_size 2 does not fit SmolLM2-135M-Instruct: 9 attention heads do not "
            "split evenly across 2 ranks; sizes that work: 1, 3") in refused.stderr + refused.stdout


@pytest.mark.timeout(180)
def test_workers_of_a_rank_0_killed_by_sigkill_exit_by_themselves():
    script = ("from backend_engine.llm import LLM\n"
              "llm = LLM('tiny-random', enforce_eager=True, num_kv_blocks=16, num_threads=1, tensor_parallel_size=2)\n"
              "print('ready', flush=True)\n"
              "import time; time.sleep(300)\n")
    rank0 = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert rank0.stdout.readline().strip() == "ready"
        children = psutil.Process(rank0.pid).children(recursive=True)
        assert children
        rank0.kill()  # no handler, no atexit: the workers must notice on their own
        rank0.wait()
        assert gone(children, timeout_s=10)
    finally:
        if rank0.poll() is None:
            rank0.kill()
