"""Read a GGUF file's tensors straight into our formats, under Hugging Face names.

Nearest format per GGML type, for `--quantization int4`:
- Q4_0, Q4_1, Q4_K → `Int4Weight` with groups of 32, exactly (the same 4-bit values; Q4_K's
  6-bit sub-block scales and mins multiplied out);
- Q8_0, Q6_K, Q5_0, Q5_1, Q5_K → `Int8Weight` per channel (re-quantised from the values in
  memory: there is no 8-bit group-wise kernel, and 5 or 6 bits squeezed into 4 would lose more
  than the file did);
- F32, F16, BF16 → plain tensors (quantised to the target format at load like any fp weight).
`--quantization int8` turns every linear weight into int8 per channel. Token embeddings and norms
become fp tensors (embeddings are gathered, not multiplied). Nothing is written to disk.

Names and values follow transformers' reading of the same file: llama.cpp's q/k row order for
its rotary layout is undone for Llama, and Gemma's norms, which llama.cpp stores as 1 + w, come
back as w.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import torch

from backend_engine.errors import ModelLoadError
from backend_engine.quant.formats import Int4Weight, LinearWeight, pack_nibbles, quantize_int8

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
DEQUANTIZED_TYPES = ("Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K")
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = FLOAT_TYPES + INT4_TYPES + DEQUANTIZED_TYPES

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma 3 names its four norms otherwise: ffn_norm is the one before the MLP
_ARCH_LAYER_NAMES = {"gemma3": {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                                "ffn_norm": "pre_feedforward_layernorm",
                                "post_ffw_norm": "post_feedforward_layernorm"}}
_NORMS_PLUS_ONE = ("gemma", "gemma2", "gemma3")  # llama.cpp stores these norms as 1 + w
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_EMBEDDING_OR_NORM = re.compile(r"(embed_tokens|norm)\.weight$")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def read_gguf(path: Path):
    """gguf's `GGUFReader` over the file, its header parsed about 3x faster: the reader slices
    its memory map once per value of every field (a Gemma 3 tokenizer's 262,144 strings), and
    a slice of an `np.memmap` runs memmap's Python `__array_finalize__`; here the slices come
    from a plain ndarray view of the same map. Values and tensors are the reader's own."""
    import gguf

    class Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:  # self.data is the memmap the constructor opened
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    return Reader(str(path))


def stored_format(path: Path) -> tuple[str | None, str]:
    """What `_stored_format` says of the file as it is now (memoised per file version: the
    launcher and each replica ask it before loading)."""
    stat = path.stat()
    return _stored_format(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _stored_format(path: str, mtime_ns: int, size: int) -> tuple[str | None, str]:
    """The format a GGUF's linear weights are served in when no --quantization is given: the
    nearest to what the file stores (int4 where any layer weight is a 4-bit type, int8 where
    they are 8- or 6-bit, None for float files), and the GGML types seen, for the log."""
    reader = read_gguf(Path(path))
    arch = _field_str(reader, "general.architecture")
    kinds = {t.tensor_type.name for t in reader.tensors
             if (name := hf_name(t.name, arch)) is not None and not _EMBEDDING_OR_NORM.search(name)
             and t.data.ndim > 1}
    if kinds & set(INT4_TYPES):
        return "int4", ", ".join(sorted(kinds))
    if kinds & set(DEQUANTIZED_TYPES):
        return "int8", ", ".join(sorted(kinds))
    return None, ", ".join(sorted(kinds))


def load_gguf_weights(path: Path, target: str, num_heads: int,
                      num_kv_heads: int) -> dict[str, LinearWeight]:
    """target: "int4" or "int8". Checks every tensor's type before decoding any."""
    reader = read_gguf(path)
    arch = _field_str(reader, "general.architecture")
    tensors = []
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"GGUF tensor {t.name} in {path.name} has type {kind}, which kvgate cannot "
                f"load; supported: {', '.join(SUPPORTED_TYPES)}")
        name = hf_name(t.name, arch)
        if name is None:
            raise ModelLoadError(f"GGUF tensor {t.name} in {path.name} has no place in a "
                                 f"{arch} model")
        tensors.append((name, t))
    weights: dict[str, LinearWeight] = {}
    for name, t in tensors:
        w = _decode(t, target, fp=bool(_EMBEDDING_OR_NORM.search(name)) or t.data.ndim == 1)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = num_heads if ".q_proj." in name else num_kv_heads
            w = _permute_rows(w, _unrope_order(_rows(w), heads))
        if arch in _NORMS_PLUS_ONE and name.endswith("norm.weight"):
            w = w - 1.0
        weights[name] = w
    return weights


def _field_str(reader, key: str) -> str:
    field = reader.fields.get(key)
    return bytes(field.parts[field.data[0]]).decode() if field else ""


def _decode(t, target: str, fp: bool) -> LinearWeight:
    kind = t.tensor_type.name
    if kind in FLOAT_TYPES:
        return _float_tensor(t)
    if kind in INT4_TYPES and target == "int4" and not fp:
        return _int4(t)
    import gguf

    values = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type)))
    values = values.reshape(t.data.shape[0], -1).float()
    return values if fp else quantize_int8(values)


def _float_tensor(t) -> torch.Tensor:
    data = np.array(t.data, copy=True)  # out of the read-only memory map
    if t.tensor_type.name == "BF16":  # stored as raw 16-bit words
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).float()
    return torch.from_numpy(data).float()


def _int4(t) -> Int4Weight:
    """Decode 4-bit blocks into (values, scale, min) per group of 32: w = q * scale + min."""
    kind = t.tensor_type.name
    rows = t.data.shape[0]
    raw = np.ascontiguousarray(t.data).reshape(rows, -1)
    if kind == "Q4_K":
        q, scales, mins = _q4_k(raw)
    else:
        header = 2 if kind == "Q4_0" else 4
        blocks = raw.reshape(-1, header + 16)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
        mins = (blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
                if kind == "Q4_1" else -8.0 * d)
        scales = d
        qs = blocks[:, header:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # elements 0..15, then 16..31
    q = torch.from_numpy(q.reshape(rows, -1).astype(np.uint8))
    return Int4Weight(pack_nibbles(q).contiguous(),
                      torch.from_numpy(np.asarray(scales, np.float32).reshape(rows, -1)),
                      torch.from_numpy(np.asarray(mins, np.float32).reshape(rows, -1)), 32)


def _q4_k(raw: np.ndarray):
    """Super-blocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of values
    (four 64-element chunks; low nibbles are the chunk's first 32, high nibbles the next)."""
    import gguf

    blocks = raw.reshape(-1, 144)
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, 8 * 32)
    return q, d * sc.astype(np.float32), -dmin * m.astype(np.float32)


def _rows(w: LinearWeight) -> int:
    return w.shape[0]


def _unrope_order(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp stores q/k rows interleaved for its rotary layout; this is the row order that
    undoes it (the permutation transformers applies when it reads a GGUF)."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)


def _permute_rows(w: LinearWeight, order: torch.Tensor) -> LinearWeight:
    if isinstance(w, torch.Tensor):
        return w[order].contiguous()
    if isinstance(w, Int4Weight):
        return Int4Weight(w.qweight[order].contiguous(), w.scales[order].contiguous(),
                          w.mins[order].contiguous(), w.group_size, w.perm)
    return type(w)(w.qweight[order].contiguous(), w.scales[order].contiguous())
