"""Achieved HBM bandwidth of the paged decode-attention kernel against the GPU's peak.

Decode attention is memory-bound: every step reads each sequence's whole K/V once. So achieved
bandwidth = K/V bytes read / kernel time, and its fraction of the device's peak says how close
the kernel is to the hardware. Blocks are handed out shuffled, as a busy block pool would.
Needs a CUDA GPU; prints one JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch

from backend_engine.accel.cuda.decode_attention import paged_decode_attention
from benchmarks import results_file

# Published peak bandwidth (GB/s) for devices whose properties lack the memory clock/bus width.
KNOWN_PEAK_GB_S = {"H200": 4800, "H100 SXM": 3350, "H100 NVL": 3900, "H100 PCIe": 2000,
                   "H100": 3350, "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100": 1555,
                   "L40S": 864, "L40": 864, "L4": 300, "A10G": 600, "A10": 600, "T4": 320,
                   "V100": 900, "RTX 4090": 1008, "RTX 3090": 936}


def peak_bandwidth_gb_s(device: torch.device) -> tuple[float | None, str]:
    """Theoretical peak: double data rate x bus width x memory clock, else a known figure."""
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "device properties"
    for name, peak in KNOWN_PEAK_GB_S.items():  # most specific names first
        if name in props.name:
            return float(peak), "published figure"
    return None, "unknown device"


def _time_ms(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth_gb_s(device: torch.device, megabytes: int = 1024) -> float:
    """What a plain device-to-device copy reaches: the practical ceiling."""
    src = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = _time_ms(lambda: dst.copy_(src), 10)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def decode_bandwidth_gb_s(batch: int, heads: int, kv_heads: int, head_dim: int,
                          context_len: int, block_size: int, dtype: torch.dtype,
                          device: torch.device, iters: int = 20) -> tuple[float, float]:
    """(achieved GB/s, ms per call) for one decode-attention call over a full paged batch."""
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context_len, dtype=torch.int32, device=device)
    query = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
    out = torch.empty_like(query)

    def call():
        paged_decode_attention(query, k_cache, v_cache, tables, lens, head_dim ** -0.5,
                               context_len, out=out)

    call()  # compile
    torch.cuda.synchronize()
    ms = _time_ms(call, iters)
    kv_bytes = 2 * batch * context_len * kv_heads * head_dim * k_cache.element_size()
    return kv_bytes / (ms * 1e-3) / 1e9, ms


SHAPES = {  # name: (batch, heads, kv_heads, head_dim, context_len, block_size)
    "llama8b_like": (64, 32, 8, 128, 4096, 16),  # the headline: GQA 4, long contexts
    "smollm2": (64, 9, 3, 64, 2048, 16),  # the default model's shape
}


def run(dtype: torch.dtype = torch.float16) -> dict:
    device = torch.device("cuda")
    peak, source = peak_bandwidth_gb_s(device)
    copy = copy_bandwidth_gb_s(device)
    result = {"device": torch.cuda.get_device_name(device), "peak_gb_s": peak,
              "peak_source": source, "copy_gb_s": round(copy, 1)}
    for name, shape in SHAPES.items():
        achieved, ms = decode_bandwidth_gb_s(*shape, dtype=dtype, device=device)
        result[name] = {"gb_s": round(achieved, 1), "ms": round(ms, 3),
                        "fraction_of_peak": round(achieved / peak, 3) if peak else None,
                        "fraction_of_copy": round(achieved / copy, 3)}
    headline = result["llama8b_like"]
    result["decode_attn_bw_fraction"] = headline["fraction_of_peak"] \
        if headline["fraction_of_peak"] is not None else headline["fraction_of_copy"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_bandwidth needs a CUDA GPU")
    result = run(getattr(torch, args.dtype))
    print(json.dumps(result))
    results_file.write("decode_bandwidth", result, {"args": vars(args)})


if __name__ == "__main__":
    main()
