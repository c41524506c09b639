"""The benchmarks' llama-server wrapper says why the server did not start (no build needed:
stand-in binaries)."""

from __future__ import annotations

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


def _gguf(path, arch: str, template: str | None):
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch,template,args", [
    ("gemma3", None, ["--chat-template", "gemma"]),  # the Gemma 3 270M file: no template
    ("gemma3", "{{ messages }}", []),  # the file's own template wins
    ("llama", None, []),  # llama-server's own fallback
])
def test_a_gguf_without_a_chat_template_gets_llamacpps_builtin_one(tmp_path, arch, template,
                                                                     args):
    gguf = _gguf(tmp_path / "model.gguf", arch, template)
    assert llamacpp_server.chat_template_args(gguf) == args
    command = LlamaServer(gguf=gguf).command(tmp_path)
    assert ("--chat-template" in command) == bool(args)
