"""The CUDA path's Triton kernels: paged attention, KV stores, quantised matmuls."""
