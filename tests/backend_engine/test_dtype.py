"""`--dtype auto` is float32 on every CPU, whatever its flags (in bf16 there a sequence's greedy
tokens change with its batch), decided when the engine starts (as is the device's ITL target)."""

from backend_engine.dtype import cpu_has_native_bf16, resolve_dtype

ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
ICELAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
SAPPHIRE = "flags\t\t: avx512f amx_bf16 amx_tile\n"


def test_bf16_flags_are_read_from_cpuinfo():
    assert cpu_has_native_bf16(ZEN4) and cpu_has_native_bf16(SAPPHIRE)
    assert not cpu_has_native_bf16(ICELAKE) and not cpu_has_native_bf16("")


def test_explicit_dtypes_pass_through_and_auto_resolves():
    assert resolve_dtype("float16", "cpu") == "float16"
    assert resolve_dtype("auto", "cpu") == "float32"


def test_the_engine_decides_auto_values_for_its_device_when_it_starts():
    from backend_engine.config import EngineConfig
    from backend_engine.engine import for_device

    cpu = for_device(EngineConfig())
    assert cpu.dtype == "float32" and cpu.target_itl_ms == 250.0
    assert EngineConfig().dtype == "auto" and EngineConfig().target_itl_ms is None
    fixed = for_device(EngineConfig(dtype="float16", target_itl_ms=0))
    assert (fixed.dtype, fixed.target_itl_ms) == ("float16", 0)  # 0: no ITL target
