"""The `tiles` form of prompt rows: a quantised CPU weight dequantised for the call, then GEMMs
over fixed row tiles.

torch's weight-only kernels (kernels.py) stream a row at a time: at one row they beat any GEMM,
but from ~64 rows on they are slower than a GEMM (several times on CPUs that compute bf16 in
hardware). A prompt's rows come in hundreds, so there they take this form: the weight
dequantised to `GEMM_DTYPE` (bf16 where the CPU computes it natively, fp32 elsewhere) for the
call (int8: the values, exact in both, with the channel scales applied to the output; int4:
(q - 8) * scale + zero per group, rounded once), then `torch.mm` over tiles of exactly
`TILE_ROWS` rows, the last one padded with zero rows.

Why tiles: a BLAS GEMM picks its blocking (and so its summation order) from the row count, so
one call over 37 rows and one over 512 give a row different bits. Every tile here has the same
shape, and a row's bits then depend only on the row itself (tested at every row offset within a
tile and with any neighbours: tests/backend_engine/accel/cpu/test_tiles.py), so a prompt gives
the same tokens however the scheduler chunks it, batches it or finds its prefix cached.

Resident weights: where the plan keeps them (`keep_resident`: the dequantised copies of the
model's tiled weights fit `RESIDENT_BUDGET_BYTES`, a rule of the model's size alone), each
weight's dequantised copy is made once at load, by the same code as the per-call one (the same
bits), and the tiles read it instead of dequantising at every call.

Each kind's conversion and tile loop run as one custom op, so Inductor treats them as a call
and the compiled layers keep them whole; int4's dequantisation inside is compiled on its own for
each weight shape (traced into the layers' dynamic-row graph, Inductor's loop ran far slower).
"""

from __future__ import annotations

import torch

from backend_engine.accel.compile import Compiled
from backend_engine.accel.cpu.attached import Attachments
from backend_engine.accel.cpu.kernels import CpuInt4Weight, CpuInt8Weight
from backend_engine.dtype import cpu_has_native_bf16

# the GEMMs' dtype: bf16 where the CPU computes it in hardware (AVX512-BF16, AMX), else fp32,
# whose GEMM there beats bf16's emulated one several times (a fact of the CPU, read once)
GEMM_DTYPE = torch.bfloat16 if cpu_has_native_bf16() else torch.float32

# the most bytes of dequantised prompt weights kept resident (the default model's, in fp32,
# take ~0.4 GiB; a 1B-parameter model's would take 4 GiB: dequantised per call)
RESIDENT_BUDGET_BYTES = 1 << 30

TILE_ROWS = 64  # rows per GEMM call (measured: 32 was ~1.4x slower at 512 rows, 128 pads more)


def tiled_mm(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight_t [K, N] in weight_t's dtype, as calls over `TILE_ROWS` rows each."""
    m = x.shape[0]
    pad = -m % TILE_ROWS
    x = x.to(weight_t.dtype)
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = x.new_empty(m + pad, weight_t.shape[1])
    for start in range(0, m + pad, TILE_ROWS):
        torch.mm(x[start:start + TILE_ROWS], weight_t, out=out[start:start + TILE_ROWS])
    return out[:m]


def unpack_int4(packed: torch.Tensor, block_n: int | None = None) -> torch.Tensor:
    """torch's blocked CPU int4 layout (`_convert_weight_to_int4pack_for_cpu`, uint8
    [N, K // 2]) back to the values, uint8 [N, K]. Output channels come in blocks of `block_n`
    (64 where torch's kernel is built for AVX512, 32 otherwise: `int4_block_n`) and a last block
    of the rest (a multiple of 16), each block stored input channel by input channel: in a full
    block, byte j holds channels j (low nibble) and j + block_n / 2; in the last block, channels
    2j and 2j + 1. Written as one broadcast shift, which Inductor fuses into a loop several
    times faster than a concatenation of the two nibbles, or than a transposed result."""
    block = block_n or int4_block_n() or BLOCK_NS[0]
    n, k = packed.shape[0], packed.shape[1] * 2
    full = n // block * block
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=packed.device)
    parts = []
    if full:
        b = packed[:full].reshape(full // block, k, 1, block // 2)
        v = (b >> shifts.view(1, 1, 2, 1)) & 15  # [blocks, K, 2, block / 2]
        parts.append(v.permute(0, 2, 3, 1).reshape(full, k))
    if n > full:
        b = packed[full:].reshape(k, (n - full) // 2, 1)
        parts.append(((b >> shifts) & 15).reshape(k, n - full).t())  # channels 2j, 2j + 1
    return torch.cat(parts) if len(parts) > 1 else parts[0]


BLOCK_NS = (64, 32)  # the block widths torch's int4 CPU layout has used
_block_n: int | None | bool = False  # int4_block_n's answer (False: not probed yet)


def int4_block_n() -> int | None:
    """The block width of the int4 layout this torch writes on this CPU, probed once a process
    on shapes with both kinds of block (models probe at load, so compiled code reads the
    answer); None if it is none `unpack_int4` reads (int4 prompt rows then keep the kernel)."""
    global _block_n
    if _block_n is False:
        gen = torch.Generator().manual_seed(0)
        shapes = [torch.randint(0, 16, (n, 64), dtype=torch.int32, generator=gen)
                  for n in (64, 112, 48)]
        packed = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1) for q in shapes]
        _block_n = next((block for block in BLOCK_NS if all(
            torch.equal(unpack_int4(p, block).to(torch.int32), q)
            for p, q in zip(packed, shapes))), None)
    return _block_n


def int4_layout_checked() -> bool:
    return int4_block_n() is not None


def dequantize_int4(packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """The grouped weight in `GEMM_DTYPE` [N_padded, K], from the kernel's own layout."""
    n, k = packed.shape[0], packed.shape[1] * 2
    v = unpack_int4(packed).view(n, k // group_size, group_size).float() - 8.0
    sz = scales_and_zeros.float()  # [K // group_size, N, 2]
    scales, zeros = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]
    return (v * scales + zeros).view(n, k).to(GEMM_DTYPE)


# each resident weight's dequantised copy, `GEMM_DTYPE` [N(_padded), K], found from its int8
# values or int4 packed tensor (what the custom ops below are given)
_resident: Attachments[torch.Tensor] = Attachments()


def _tiled_key(w: CpuInt4Weight | CpuInt8Weight) -> torch.Tensor:
    return w.packed if isinstance(w, CpuInt4Weight) else w.qweight


def resident_bytes(weights: list) -> int:
    """Bytes the dequantised copies of `weights` (int8 and int4 CPU weights, each counted
    once) take in `GEMM_DTYPE`."""
    keys = {_tiled_key(w).data_ptr(): w for w in weights}
    size = torch.empty((), dtype=GEMM_DTYPE).element_size()
    return sum(_tiled_key(w).shape[0] * w.shape[1] * size for w in keys.values())


def keep_resident(weights: list) -> None:
    """Dequantise each weight once now, and have its tiles read that copy for its life."""
    with torch.no_grad():
        for w in weights:
            key = _tiled_key(w)
            if _resident.lookup(key) is None:
                copy = (_fused_dequantize(w.packed, w.scales_and_zeros, w.group_size)
                        if isinstance(w, CpuInt4Weight) else _int8_values(w.qweight))
                _resident.attach(w, key, copy)


def extra_bytes(w) -> int:
    """Bytes of the weight's resident dequantised copy, else 0."""
    if not isinstance(w, (CpuInt4Weight, CpuInt8Weight)):
        return 0
    copy = _resident.lookup(_tiled_key(w))
    return copy.nbytes if copy is not None else 0


@torch.library.custom_op("kvgate::int8_tiled_mm", mutates_args=())
def int8_tiled_mm(x: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ the int8 values' transpose (exact in bf16), in `TILE_ROWS`-row tiles; one op,
    so compiled layers do not trace the conversion into their dynamic-row graph."""
    weight = _resident.lookup(qweight)
    return tiled_mm(x, (weight if weight is not None else _int8_values(qweight)).t())


@int8_tiled_mm.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0], dtype=GEMM_DTYPE)


def _int8_values(qweight: torch.Tensor) -> torch.Tensor:
    return qweight.to(GEMM_DTYPE)


_fused_dequantize = Compiled(dequantize_int4, "the int4 dequantisation", per_shape=True)


@torch.library.custom_op("kvgate::int4_tiled_mm", mutates_args=())
def int4_tiled_mm(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                  group_size: int) -> torch.Tensor:
    """x [M, K] @ the int4 weight's dequantised transpose, in `TILE_ROWS`-row tiles; one op,
    so compiled layers call it (and the static-shape dequantisation) instead of tracing it."""
    weight = _resident.lookup(packed)
    if weight is None:
        weight = _fused_dequantize(packed, scales_and_zeros, group_size)
    return tiled_mm(x, weight.t())


@int4_tiled_mm.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
      group_size: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0], dtype=GEMM_DTYPE)


def int8_tiles(x: torch.Tensor, w: CpuInt8Weight) -> torch.Tensor:
    y = int8_tiled_mm(x, w.qweight).float() * w.scales_fp32
    return y.to(x.dtype)


def int4_call(op, x: torch.Tensor, w: CpuInt4Weight) -> torch.Tensor:
    """An int4 prompt op (x, packed, scales_and_zeros, group_size) over w: the input channels in
    the groups' order (GPTQ act-order), the padding channels dropped, x's dtype back."""
    if w.perm is not None:
        x = x.index_select(1, w.perm)
    y = op(x, w.packed, w.scales_and_zeros, w.group_size)
    if y.shape[1] != w.out_features:
        y = y[:, :w.out_features].contiguous()
    return y.to(x.dtype)


def int4_tiles(x: torch.Tensor, w: CpuInt4Weight) -> torch.Tensor:
    return int4_call(int4_tiled_mm, x, w)
