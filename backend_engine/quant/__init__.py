"""Quantised weights: formats, loaders (GGUF, AWQ, GPTQ) and the kernels' layouts.
See docs/engine/quantization.md."""
