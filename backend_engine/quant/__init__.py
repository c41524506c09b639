"""Quantised weights: the canonical int8/int4 formats and the loaders (GGUF, AWQ, GPTQ); the
devices' layouts and forms are in accel/.
See docs/engine/quantization.md."""
