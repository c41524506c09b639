"""`--dtype auto` picks bfloat16 only where the CPU computes it natively."""

from backend_engine.dtype import cpu_has_native_bf16, resolve_dtype

ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
ICELAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
SAPPHIRE = "flags\t\t: avx512f amx_bf16 amx_tile\n"


def test_bf16_flags_are_read_from_cpuinfo():
    assert cpu_has_native_bf16(ZEN4) and cpu_has_native_bf16(SAPPHIRE)
    assert not cpu_has_native_bf16(ICELAKE) and not cpu_has_native_bf16("")


def test_explicit_dtypes_pass_through_and_auto_resolves():
    assert resolve_dtype("float16", "cpu") == "float16"
    assert resolve_dtype("auto", "cpu") in ("bfloat16", "float32")
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if cpu_has_native_bf16() else "float32")
