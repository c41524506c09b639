"""`kvgate up` end to end with real tiny-random replicas: it prints a working base_url, shows no
key on any child's command line or log, restarts a replica killed with SIGKILL, and on SIGTERM
leaves no child behind. The replicas run
eagerly (`--enforce-eager`): these are tests of the supervisor, and compiling the tiny model's
graphs would double their time (the compiled plan has its own tests, tests/backend_engine/accel)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvgate.launcher.plan import free_port, port_is_free

REPLICAS = 2


class Output:
    """The supervisor's stdout, line by line, readable with a deadline."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self._queue.put(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        for line in self.lines:
            if m := re.search(pattern, line):
                return m
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            self.lines.append(line)
            if m := re.search(pattern, line):
                return m
        raise TimeoutError(f"no line matching {pattern!r} in {timeout}s; output:\n" + "\n".join(self.lines))


def free_port_run(n: int) -> int:
    for _ in range(50):
        base = free_port()
        if base + n < 65536 and all(port_is_free("127.0.0.1", base + i) for i in range(n)):
            return base
    raise RuntimeError("no run of free ports")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def start_up(*argv: str) -> tuple[subprocess.Popen, Output]:
    proc = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "up", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, Output(proc)


def chat(base_url: str, api_key: str) -> dict:
    body = {"model": "tiny-random", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    resp = httpx.post(f"{base_url}/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {api_key}"})
    assert resp.status_code == 200, resp.text
    return resp.json()


def assert_no_key_visible(supervisor_pid: int, log_dir, keys: list[str]) -> None:
    """What any local user sees: no key on a command line (`ps`, /proc/*/cmdline), and none in
    the children's logs (the supervisor's banner on the terminal shows them once)."""
    import psutil

    procs = psutil.Process(supervisor_pid).children(recursive=True)
    assert len(procs) >= 4  # redis, the gateway, the replicas
    for p in procs:
        with open(f"/proc/{p.pid}/cmdline", "rb") as f:
            cmdline = f.read().decode(errors="replace")
        assert not any(k in cmdline for k in keys), p.name()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert not any(k in ps for k in keys)
    for log in log_dir.glob("*.log"):
        assert not any(k in log.read_text(errors="replace") for k in keys), log.name


@pytest.mark.timeout(240)
def test_up_serves_restarts_a_killed_replica_and_stops_every_child(tmp_path):
    gateways = 1  # with --redis: every kind of child kvgate up runs
    port = free_port_run(gateways + REPLICAS)
    proc, out = start_up("--model", "tiny-random", "--enforce-eager", "--replicas", str(REPLICAS), "--gateways", str(gateways),
                         "--redis", "--port", str(port), "--log-dir", str(tmp_path), "--log-level", "warning")
    try:
        base_url = out.wait_for(r"OpenAI base_url:\s+(\S+)", 150).group(1)
        assert base_url == f"http://127.0.0.1:{port}/v1"
        replicas = re.findall(r"(http://\S+) \(pid (\d+)\)", out.wait_for(r"^\s+replicas:.*", 5).group(0))
        assert [url for url, _ in replicas] == [f"http://127.0.0.1:{port + gateways + i}" for i in range(REPLICAS)]
        pids = [int(pid) for _, pid in replicas]
        pids.append(int(out.wait_for(r"redis:\s+redis://\S+ \(pid (\d+)\)", 5).group(1)))
        pids.append(int(out.wait_for(r"gateways:\s+\S+ \(pid (\d+)\)", 5).group(1)))
        # The key the printed Python snippet uses (generated: gateways sharing Redis need one).
        api_key = out.wait_for(r'OpenAI\(base_url="\S+", api_key="([^"]+)"\)', 5).group(1)
        assert chat(base_url, api_key)["choices"][0]["message"]["role"] == "assistant"
        admin_key = out.wait_for(r"admin key: ([^)\s]+)\)", 5).group(1)
        assert_no_key_visible(proc.pid, tmp_path, [api_key, admin_key])

        victim_url, victim_pid = replicas[-1][0], int(replicas[-1][1])
        os.kill(victim_pid, signal.SIGKILL)
        out.wait_for(rf"replica-{REPLICAS} \(pid {victim_pid}\) killed by SIGKILL; restarting", 10)
        new_pid = int(out.wait_for(rf"replica-{REPLICAS}: healthy again at {victim_url} \(pid (\d+)\)", 90).group(1))
        assert new_pid != victim_pid and httpx.get(f"{victim_url}/health", timeout=5).status_code == 200
        pids.append(new_pid)
        chat(base_url, api_key)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        out.wait_for(r"kvgate up: stopped", 5)
        assert [pid for pid in pids if alive(pid)] == []
        assert all(port_is_free("127.0.0.1", port + i) for i in range(gateways + REPLICAS))
    finally:
        if proc.poll() is None:  # children follow through their parent-death signal
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(180)
def test_up_envoy_serves_through_envoy_and_the_picker(tmp_path):
    port = free_port_run(2)
    proc, out = start_up("--model", "tiny-random", "--enforce-eager", "--replicas", "1", "--envoy",
                         "--port", str(port), "--log-dir", str(tmp_path), "--log-level", "warning")
    try:
        base_url = out.wait_for(r"OpenAI base_url:\s+(\S+)", 150).group(1)
        assert base_url == f"http://127.0.0.1:{port}/v1"
        envoy_pid = int(out.wait_for(r"envoy:\s+\S+ \(pid (\d+)\)", 5).group(1))
        picker_url, picker_pid = out.wait_for(r"picker:\s+(\S+) \(pid (\d+)\)", 5).groups()
        r = httpx.post(f"{base_url}/chat/completions", timeout=60, json={
            "model": "tiny-random", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.headers["x-kvgate-replica"] == f"127.0.0.1:{port + 1}"
        assert httpx.get(picker_url + "/health", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        out.wait_for(r"stopping envoy…", 5)  # stopped first: no new traffic while the rest stop
        assert not alive(envoy_pid) and not alive(int(picker_pid))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(120)
def test_a_replica_that_fails_to_start_stops_up_with_its_log(tmp_path):
    port = free_port_run(1)
    proc, out = start_up("--model", str(tmp_path / "no-such-model"), "--replicas", "1", "--gateways", "0",
                         "--port", str(port), "--log-dir", str(tmp_path), "--log-level", "error")
    try:
        assert proc.wait(timeout=100) == 1
        out.wait_for(r"replica-1 \(pid \d+\) exited with code 1; while starting", 5)
        out.wait_for(r"^\s+\| ", 5)  # the tail of its log follows
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(120)
def test_children_die_with_a_supervisor_killed_by_sigkill(tmp_path):
    port = free_port_run(1)
    proc, out = start_up("--model", "tiny-random", "--enforce-eager", "--replicas", "1", "--gateways", "0", "--redis",
                         "--port", str(port), "--log-dir", str(tmp_path), "--log-level", "warning")
    try:
        out.wait_for(r"Ctrl-C stops everything", 100)
        pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", "\n".join(out.lines))]
        assert len(pids) == 2  # the replica and redis
        proc.kill()  # no handler runs: the kernel's parent-death signal must stop the children
        proc.wait()
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [pid for pid in pids if alive(pid)] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def complete_tokens(base_url: str) -> str:
    body = {"model": "tiny-random", "prompt": [1, 504, 3287, 282, 4052], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    resp = httpx.post(f"{base_url}/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


@pytest.mark.timeout(300)
def test_up_runs_a_tensor_parallel_replica_and_restarts_its_whole_group(tmp_path):
    import psutil
    import torch

    from backend_engine.llm import LLM
    from backend_engine.sampling_params import SamplingParams

    threads = torch.get_num_threads()
    expected = LLM("tiny-random", enforce_eager=True, num_kv_blocks=64, num_threads=1).generate(
        [[1, 504, 3287, 282, 4052]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].text
    torch.set_num_threads(threads)
    port = free_port_run(2)
    proc, out = start_up("--model", "tiny-random", "--enforce-eager", "--replicas", "1", "--tensor-parallel-size", "2",
                         "--num-threads", "1", "--port", str(port), "--log-dir", str(tmp_path), "--log-level", "warning")
    try:
        base_url = out.wait_for(r"OpenAI base_url:\s+(\S+)", 200).group(1)
        out.wait_for(r"1 cpu replica\(s\) × 2 ranks of tiny-random", 5)
        replica_pid = int(out.wait_for(r"^\s+replicas:\s+\S+ \(pid (\d+)\)", 5).group(1))
        assert complete_tokens(base_url) == expected
        workers = [p for p in psutil.Process(replica_pid).children() if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(workers) == 1
        old = [psutil.Process(replica_pid), *psutil.Process(replica_pid).children(recursive=True)]

        workers[0].kill()  # one rank dies: the replica exits, and kvgate up restarts the group
        out.wait_for(rf"replica-1 \(pid {replica_pid}\) exited with code 1; restarting", 60)
        new_pid = int(out.wait_for(r"replica-1: healthy again at \S+ \(pid (\d+)\)", 200).group(1))
        assert psutil.wait_procs(old, timeout=10)[1] == []
        new = [psutil.Process(new_pid), *psutil.Process(new_pid).children(recursive=True)]
        assert len(new) >= 2
        deadline = time.monotonic() + 30  # until the gateway's health check sees it back
        while httpx.get(base_url.removesuffix("/v1") + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert complete_tokens(base_url) == expected

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert psutil.wait_procs(new, timeout=10)[1] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
