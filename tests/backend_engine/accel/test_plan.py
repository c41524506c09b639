"""The execution plan (accel/plan.py): a device's class from its CPU flags alone, the table's
forms, and developer overrides checked before any weight loads."""

import pytest

from backend_engine.accel.plan import TABLE, PlanError, device_class, plan_for
from backend_engine.config import EngineConfig

AMX = "flags\t\t: fpu sse avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n"
AVX512 = "flags\t\t: fpu sse avx2 avx512f avx512_vnni avx512_bf16\n"
AVX2 = "flags\t\t: fpu sse avx2 fma\n"


@pytest.mark.parametrize("cpuinfo,cls", [(AMX, "cpu-amx"), (AVX512, "cpu-avx512"),
                                         (AVX2, "cpu"), ("", "cpu")])
def test_a_cpus_class_comes_from_its_flags(cpuinfo, cls):
    assert device_class("cpu", cpuinfo) == cls
    assert device_class("cuda:1", cpuinfo) == "cuda"


@pytest.mark.parametrize("cls", sorted(TABLE))
def test_each_class_has_a_form_for_every_format_and_row_kind(cls):
    device = "cuda" if cls == "cuda" else "cpu"
    plan = plan_for(device, {"device_class": cls})
    assert set(plan.decode) == set(plan.prompt) == {"fp", "int8", "int4"}
    assert plan.compiled == (cls != "cuda")
    assert plan.attention == ("triton" if cls == "cuda" else "torch")
    assert plan.experts == ("triton" if cls == "cuda" else "grouped")
    line = plan.describe({"int4"})
    assert line.startswith(f"plan for {cls}: int4 weights: decode rows ") and "lm_head" in line
    assert "experts" not in line and f"{plan.experts} experts" in plan.describe({"int4"}, True)


def test_the_plan_is_the_same_for_every_replica_of_a_machine():
    assert plan_for("cpu") == plan_for("cpu")  # no timing in it: nothing to differ


def test_developer_overrides_change_one_entry():
    plan = plan_for("cpu", {"prompt": "int4:tiles", "compiled": "off", "lm_head": "int4"})
    assert plan.prompt["int4"] == "tiles" and not plan.compiled and plan.lm_head == "int4"
    assert plan.decode == plan_for("cpu").decode
    every = plan_for("cpu", {"prompt": "tiles"})  # one form for every quantised format
    assert every.prompt["int8"] == every.prompt["int4"] == "tiles"
    reference = plan_for("cpu", {"plan": "reference"})
    assert set(reference.decode.values()) == set(reference.prompt.values()) == {"reference"}
    assert not reference.compiled and reference.attention == "torch"
    assert reference.experts == "grouped" and plan_for("cpu", {"experts": "triton"}).experts == "triton"


def test_tensor_parallel_and_enforce_eager_compile_nothing():
    assert not plan_for("cpu", one_rank=False).compiled
    assert not plan_for("cpu", enforce_eager=True).compiled
    with pytest.raises(PlanError, match="one rank"):
        plan_for("cpu", {"compiled": "on"}, one_rank=False)


@pytest.mark.parametrize("options,match", [
    ({"speed": "max"}, "unknown engine option"),
    ({"prompt_weights": "always"}, "prompt_weights"),
    ({"decode": "tiles"}, "decode rows of int8 weights"),
    ({"decode": "int4:template"}, "decode rows of int4 weights"),
    ({"prompt": "fp:kernel"}, "prompt rows of fp weights"),
    ({"prompt": "int8:triton"}, "does not run on CPU"),
    ({"compiled": "sometimes"}, "choose one of on, off"),
    ({"device_class": "tpu"}, "choose one of"),
    ({"device_class": "cuda"}, "the device is cpu"),
    ({"plan": "fastest"}, "only named plan"),
    ({"attention": "flash"}, "choose one of torch, triton"),
    ({"experts": "dense"}, "choose one of grouped, triton"),
])
def test_bad_overrides_are_refused_with_the_option_named(options, match):
    with pytest.raises(PlanError, match=match):
        plan_for("cpu", options)
    with pytest.raises(ValueError, match="engine option"):  # before the engine loads anything
        EngineConfig(engine_options=options).validate()


def test_w8a8_is_every_cpu_class_lm_head_and_refused_on_a_gpu():
    for cls in ("cpu", "cpu-avx512", "cpu-amx"):
        assert plan_for("cpu", {"device_class": cls}).lm_head == "w8a8"
    with pytest.raises(PlanError, match="lm_head=w8a8"):
        plan_for("cuda", {"lm_head": "w8a8"})
