"""Triton kernels for the CUDA path: KV store, paged decode and prefill attention, RMSNorm and
rotary embedding. Each module exposes plain torch-in, torch-out functions; the kernels also run
on CPU tensors under TRITON_INTERPRET=1 (set before triton is imported), which is how they are
tested against the torch reference."""
