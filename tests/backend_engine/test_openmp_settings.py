"""The engine's OpenMP default (a short spin), that a user's own setting wins, and that only an
entry point sets it: importing the engine changes no environment variable."""

import os
import subprocess
import sys

import pytest

from backend_engine.process_env import OPENMP_SETTINGS as OPENMP

DEFAULTS = "from backend_engine.process_env import set_process_defaults; set_process_defaults(); "


def _settings(code: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in OPENMP}
    code += "import os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, check=True,
                         capture_output=True, text=True).stdout.split()
    return dict(zip(OPENMP, out))


def test_default_is_a_short_spin():
    assert _settings(DEFAULTS) == {"OMP_WAIT_POLICY": "None", "GOMP_SPINCOUNT": "1000"}


@pytest.mark.parametrize("env", [{"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "300000"}])
def test_an_explicit_setting_is_kept(env):
    expected = {"OMP_WAIT_POLICY": "None", "GOMP_SPINCOUNT": "None", **env}
    assert _settings(DEFAULTS, **env) == expected


def test_importing_the_engine_sets_nothing():
    code = ("import os; before = dict(os.environ); "
            "import backend_engine, backend_engine.process_env, backend_engine.llm; "
            "print(sorted(set(os.environ.items()) ^ set(before.items())))")
    env = {k: v for k, v in os.environ.items() if k not in (*OPENMP, "TORCHINDUCTOR_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                         text=True, timeout=300).stdout.strip()
    assert out == "[]"


def test_kvgate_engine_sets_the_spin_before_torch_loads():
    # Stand in for the defaults: report whether torch was already loaded when they were set.
    code = ("import sys; import backend_engine.process_env as env; "
            "env.set_process_defaults = lambda: sys.exit('torch loaded' if 'torch' in sys.modules else 0); "
            "from kvgate.cli import main; main(['engine'])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (run.returncode, run.stderr) == (0, "")
