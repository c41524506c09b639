import os

import pytest

from backend_engine.process_env import set_process_defaults

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the suite runs servers beside the test process (more threads than cores): sleeping OpenMP
# workers never collapse there (see backend_engine/process_env.py)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
set_process_defaults()  # engines run in the test process too: the same compile cache as replicas


@pytest.fixture(scope="session")
def default_llm():
    from backend_engine.llm import LLM

    return LLM("default", enforce_eager=True, quantization="none", num_kv_blocks=512)


@pytest.fixture(scope="session", params=[None, "int8"], ids=["fp32", "int8"])
def quantization(request):
    """Engine tests on the tiny models run unquantised and with int8 weights (issue #15)."""
    return request.param


@pytest.fixture(scope="session")
def tiny_llm(quantization):
    from backend_engine.llm import LLM

    return LLM("tiny-random", enforce_eager=True, num_kv_blocks=256, max_num_batched_tokens=256,
               quantization=quantization)


_exit_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After the Triton-interpreter tests, triton's nanobind bindings print hundreds of "leaked
    instance/type/function" lines while the interpreter shuts down (their leak check runs at
    module teardown and cannot be switched off from Python). Once pytest has reported
    everything, leave without that teardown, with pytest's own exit status."""
    import sys

    if "triton" in sys.modules and _exit_status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])
