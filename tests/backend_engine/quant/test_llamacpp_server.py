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


@pytest.mark.parametrize("arch,template,gets_kvgates", [
    ("gemma3", None, True),  # the Gemma 3 270M file: no template
    ("gemma3", "{{ messages }}", False),  # the file's own template wins
    ("llama", None, False),  # llama-server's own fallback
])
def test_a_gguf_without_a_chat_template_gets_the_one_kvgate_renders(tmp_path, arch, template,
                                                                     gets_kvgates):
    from backend_engine.chat_templates import FALLBACK

    gguf = _gguf(tmp_path / "model.gguf", arch, template)
    args = llamacpp_server.chat_template_args(gguf, tmp_path)
    if gets_kvgates:
        assert args[:2] == ["--jinja", "--chat-template-file"]
        assert open(args[2]).read() == FALLBACK["gemma3_text"][0]
    else:
        assert args == []
    command = LlamaServer(gguf=gguf).command(tmp_path)
    assert ("--chat-template-file" in command) == gets_kvgates
    assert "--chat-template" not in command  # llama.cpp's built-in names are never used
