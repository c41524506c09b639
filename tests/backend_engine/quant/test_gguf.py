"""GGUF tensors load straight into our formats: 4-bit blocks exactly, 8/6-bit ones through int8,
llama's q/k row order undone as transformers does, and unsupported types refused by name."""

import shutil
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from backend_engine.errors import ModelLoadError
from backend_engine.model_loader import default_gguf_path, gguf_source, load_state_dict, resolve_model
from backend_engine.quant.formats import Int4Weight, Int8Weight
from backend_engine.quant.gguf import _decode, load_gguf_weights, read_gguf, stored_format

T = gguf.GGMLQuantizationType
ROWS, COLS = 8, 512


def _f16_bytes(rng, n, lo=0.001, hi=0.05):
    return rng.uniform(lo, hi, size=(n, 1)).astype(np.float16).view(np.uint8)


def _random_blocks(kind: str, rng) -> np.ndarray:
    """Valid random blocks of a GGML type (finite fp16 scales, any bit patterns elsewhere)."""
    block, size = gguf.GGML_QUANT_SIZES[T[kind]]
    n = ROWS * COLS // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    if kind in ("Q4_0", "Q8_0"):
        raw[:, 0:2] = _f16_bytes(rng, n)
    elif kind == "Q4_1":
        raw[:, 0:2], raw[:, 2:4] = _f16_bytes(rng, n), _f16_bytes(rng, n, -0.4, -0.01)
    elif kind == "Q4_K":
        raw[:, 0:2], raw[:, 2:4] = _f16_bytes(rng, n), _f16_bytes(rng, n)
    elif kind == "Q6_K":
        raw[:, -2:] = _f16_bytes(rng, n)
    return raw.reshape(ROWS, -1)


def _tensor(kind: str, seed: int = 0):
    data = _random_blocks(kind, np.random.default_rng(seed))
    return SimpleNamespace(name="blk.0.ffn_up.weight", tensor_type=T[kind], data=data)


def _reference(t) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(ROWS, COLS))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_4bit_blocks_load_exactly_as_int4_groups_of_32(kind):
    t = _tensor(kind)
    w = _decode(t, "int4", fp=False)
    assert isinstance(w, Int4Weight) and w.group_size == 32 and w.shape == (ROWS, COLS)
    torch.testing.assert_close(w.dequantize(), _reference(t), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q4_K"])
def test_other_blocks_and_the_int8_target_load_as_int8_per_channel(kind):
    t = _tensor(kind, seed=1)
    target = "int8" if kind == "Q4_K" else "int4"
    w = _decode(t, target, fp=False)
    assert isinstance(w, Int8Weight)
    err = (w.dequantize() - _reference(t)).abs()
    assert bool((err <= w.scales[:, None] / 2 + 1e-6).all())


def test_embeddings_and_norms_load_as_fp_tensors():
    t = _tensor("Q8_0", seed=2)
    w = _decode(t, "int4", fp=True)
    assert isinstance(w, torch.Tensor)
    torch.testing.assert_close(w, _reference(t))


@pytest.fixture(scope="module")
def default_int4():
    return load_gguf_weights(default_gguf_path(), "int4", num_heads=9, num_kv_heads=3)


def test_default_model_loads_its_q4_1_weights_as_transformers_dequantises_them(default_int4):
    fp = load_state_dict(resolve_model("default").folder)  # transformers' GGUF reader, fp32
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.5.self_attn.v_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        w = default_int4[name]
        assert isinstance(w, Int4Weight) and w.group_size == 32, name
        torch.testing.assert_close(w.dequantize(), fp[name], atol=1e-6, rtol=1e-6, msg=name)
    torch.testing.assert_close(default_int4["model.embed_tokens.weight"],
                               fp["model.embed_tokens.weight"])
    assert isinstance(default_int4["model.norm.weight"], torch.Tensor)


def test_the_fast_reader_reads_what_ggufs_own_reads():
    path = default_gguf_path()
    fast, own = read_gguf(path), gguf.GGUFReader(str(path))
    assert list(fast.fields) == list(own.fields)
    for name, field in own.fields.items():
        assert fast.fields[name].contents() == field.contents(), name
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in fast.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist()) for t in own.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(fast.tensors, own.tensors))


def test_the_stored_format_is_read_again_when_the_file_changes(tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copyfile(default_gguf_path(), path)
    assert stored_format(path)[0] == "int4" and "IQ4_NL" not in stored_format(path)[1]
    patched = _with_type(tmp_path, "blk.3.attn_v.weight", "IQ4_NL")  # a newer file, same size
    patched.replace(path)
    assert "IQ4_NL" in stored_format(path)[1]


def _with_type(tmp_path, tensor: str, kind: str):
    path = tmp_path / "patched.gguf"
    shutil.copyfile(default_gguf_path(), path)
    reader = gguf.GGUFReader(str(path), "r+")
    field = next(t.field for t in reader.tensors if t.name == tensor)
    field.parts[4][0] = int(T[kind])  # the tensor's type word in the header
    del reader
    return path


def test_an_unsupported_tensor_type_is_refused_naming_the_tensor(tmp_path):
    path = _with_type(tmp_path, "blk.3.attn_v.weight", "IQ4_NL")  # same-size blocks as Q4_0
    with pytest.raises(ModelLoadError, match=r"blk\.3\.attn_v\.weight.*IQ4_NL.*supported: F32"):
        load_gguf_weights(path, "int4", num_heads=9, num_kv_heads=3)


def test_a_cached_gguf_folder_follows_the_file_to_where_it_is_now(tmp_path, monkeypatch):
    """The weightless folder is keyed by the file's content: the same GGUF under another path
    (another checkout, a rebuilt venv) reuses it and the weights are read from the new path."""
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path / "cache"))
    first, second = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for link in (first, second):
        link.parent.mkdir()
        link.symlink_to(default_gguf_path())
    folder = resolve_model(str(first), "int4").folder
    assert gguf_source(folder) == first
    first.unlink()
    assert resolve_model(str(second), "int4").folder == folder
    assert gguf_source(folder) == second
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []
