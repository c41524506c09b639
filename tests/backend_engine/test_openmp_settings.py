"""The engine's OpenMP default (a short spin) and that a user's own setting wins."""

import os
import subprocess
import sys

import pytest

from backend_engine import OPENMP_SETTINGS as OPENMP


def _settings_after_import(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in OPENMP}
    code = ("import os, backend_engine; "
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, check=True,
                         capture_output=True, text=True).stdout.split()
    return dict(zip(OPENMP, out))


def test_default_is_a_short_spin():
    assert _settings_after_import() == {"OMP_WAIT_POLICY": "None", "GOMP_SPINCOUNT": "1000"}


@pytest.mark.parametrize("env", [{"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "300000"}])
def test_an_explicit_setting_is_kept(env):
    expected = {"OMP_WAIT_POLICY": "None", "GOMP_SPINCOUNT": "None", **env}
    assert _settings_after_import(**env) == expected

