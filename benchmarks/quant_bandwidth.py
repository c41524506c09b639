"""Achieved memory bandwidth of the Triton weight-only int8/int4 matmuls at decode (1 and 8
rows) and the prefill speed at 512 rows, against the GPU's peak. A decode matmul is memory-bound:
bandwidth = weight bytes read (values + scales) / kernel time. Needs a CUDA GPU; prints one JSON
line (run by benchmarks/gpu_check.sh)."""

from __future__ import annotations

import json

import torch

from backend_engine.accel.cuda.quant_matmul import int4_matmul, int8_matmul
from backend_engine.quant.formats import quantize_int4, quantize_int8
from benchmarks import results_file
from benchmarks.decode_bandwidth import _time_ms, copy_bandwidth_gb_s, peak_bandwidth_gb_s

N, K, GROUP = 8192, 8192, 32


def main() -> None:
    device = torch.device("cuda")
    w = torch.randn(N, K) * 0.02
    q8, q4 = quantize_int8(w), quantize_int4(w, GROUP)
    i8 = (q8.qweight.to(device), q8.scales.to(device))
    i4 = (q4.qweight.to(device), q4.scales.to(device), q4.mins.to(device))
    bytes8 = sum(t.nbytes for t in i8)
    bytes4 = sum(t.nbytes for t in i4)
    peak, source = peak_bandwidth_gb_s(device)
    result = {"device": torch.cuda.get_device_name(device), "peak_gb_s": peak,
              "peak_source": source, "copy_gb_s": copy_bandwidth_gb_s(device)}
    for rows in (1, 8):
        x = torch.randn(rows, K, dtype=torch.bfloat16, device=device)
        ms8 = _time_ms(lambda: int8_matmul(x, *i8), 20)
        ms4 = _time_ms(lambda: int4_matmul(x, *i4, GROUP), 20)
        result[f"int8_rows{rows}_gb_s"] = bytes8 / (ms8 * 1e-3) / 1e9
        result[f"int4_rows{rows}_gb_s"] = bytes4 / (ms4 * 1e-3) / 1e9
    x = torch.randn(512, K, dtype=torch.bfloat16, device=device)
    dense = w.to(device, torch.bfloat16)
    for name, fn in (("int8", lambda: int8_matmul(x, *i8)), ("int4", lambda: int4_matmul(x, *i4, GROUP)),
                     ("bf16", lambda: x @ dense.t())):
        result[f"{name}_rows512_tflops"] = 2 * 512 * N * K / (_time_ms(fn, 10) * 1e-3) / 1e12
    if peak:
        result["quant_decode_bw_fraction"] = max(result["int4_rows1_gb_s"],
                                                 result["int8_rows1_gb_s"]) / peak
    print(json.dumps(result))
    results_file.write("quant_bandwidth", result)


if __name__ == "__main__":
    main()
