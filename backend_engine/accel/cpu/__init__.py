"""CPU forms of the Linear: packed int8/int4 layouts, their kernels and the GEMM template."""
