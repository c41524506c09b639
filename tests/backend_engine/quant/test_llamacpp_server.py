"""The benchmarks' llama-server wrapper says why the server did not start, and keeps it running
whatever the caller's stdin (no build needed: fake servers)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from benchmarks import llamacpp_server
from benchmarks.llamacpp_server import LlamaServer, LlamaServerUnavailable


@pytest.mark.parametrize("body,message", [
    ('kill -ILL $$', "SIGILL .*CMAKE_ARGS"),  # e.g. AMX kernels on a VM that refuses AMX
    ("exit 3", "exited with code 3"),
])
def test_a_server_that_dies_at_start_is_reported_with_its_cause(tmp_path, monkeypatch, body,
                                                                 message):
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\n{body}\n")
    binary.chmod(0o755)
    monkeypatch.setattr(llamacpp_server, "ensure_built", lambda say: tmp_path)
    monkeypatch.setattr(llamacpp_server, "soname_links", lambda folder: folder)
    with pytest.raises(LlamaServerUnavailable, match=message):
        with LlamaServer(gguf=tmp_path / "model.gguf", say=lambda *a: None):
            pass


FAKE_SERVER = """#!{python}
import http.server, sys, threading
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
sys.stdin.read()  # like the real llama-server: its stdin at EOF, it shuts down
sys.exit(9)
"""


def test_the_server_outlives_a_caller_whose_stdin_is_at_eof(tmp_path, monkeypatch):
    """A benchmark run `< /dev/null` lost llama-server seconds into its requests; the wrapper
    now gives it a stdin of its own, open until the server is stopped."""
    binary = tmp_path / "llama-server"
    binary.write_text(FAKE_SERVER.format(python=sys.executable))
    binary.chmod(0o755)
    monkeypatch.setattr(llamacpp_server, "ensure_built", lambda say: tmp_path)
    monkeypatch.setattr(llamacpp_server, "soname_links", lambda folder: folder)
    saved = os.dup(0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # as `python -m benchmarks.quant_speed < /dev/null`
    try:
        server = LlamaServer(gguf=tmp_path / "model.gguf", say=lambda *a: None)
        with server:
            time.sleep(0.5)
            assert server._proc.poll() is None
        assert server._proc.returncode is not None  # stopped with the wrapper
    finally:
        os.dup2(saved, 0)
        os.close(saved)
        os.close(null)
