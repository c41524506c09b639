"""Inductor's compiled code goes under kvgate's cache root (not /tmp) once a process sets
kvgate's defaults, unless the user says where; and Inductor really writes there."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

NAMES = ("KVGATE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
DEFAULTS = "from backend_engine.process_env import set_process_defaults; set_process_defaults()\n"


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in NAMES}
    return subprocess.run([sys.executable, "-c", DEFAULTS + code], env={**clean, **env}, check=True,
                          capture_output=True, text=True, timeout=300).stdout.strip()


def test_default_is_under_the_cache_root(tmp_path):
    out = _run("import os; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])",
               KVGATE_CACHE_DIR=str(tmp_path))
    assert Path(out).parent == tmp_path / "inductor"


def test_the_folder_changes_with_the_code_it_compiles(tmp_path, monkeypatch):
    """Inductor's keys miss a custom op's fake implementation: a change to accel/ or models/
    must not load graphs compiled for the code before it."""
    from backend_engine import process_env

    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path))
    before = process_env.inductor_cache()
    assert before == process_env.inductor_cache()  # stable for one version of the code
    source = tmp_path / "backend_engine"
    shutil.copytree(Path(process_env.__file__).parent, source,
                    ignore=shutil.ignore_patterns("__pycache__"))
    (source / "accel" / "forms.py").write_text((source / "accel" / "forms.py").read_text() + "#")
    monkeypatch.setattr(process_env, "__file__", str(source / "process_env.py"))
    assert process_env.inductor_cache() != before


def test_without_kvgate_cache_dir_it_is_the_home_cache(tmp_path):
    out = _run("import os; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])",
               HOME=str(tmp_path))
    assert Path(out).parent == tmp_path / ".cache" / "kvgate" / "inductor"


def test_an_explicit_setting_is_kept(tmp_path):
    mine = tmp_path / "mine"
    out = _run("import os; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])",
               KVGATE_CACHE_DIR=str(tmp_path / "root"), TORCHINDUCTOR_CACHE_DIR=str(mine))
    assert Path(out) == mine


def test_inductor_writes_its_code_there(tmp_path):
    code = ("import torch\n"
            "f = torch.compile(lambda x: (x * 2 + 1).sum(), fullgraph=True)\n"
            "print(float(f(torch.arange(8.0))))")
    assert _run(code, KVGATE_CACHE_DIR=str(tmp_path)) == "64.0"
    written = list((tmp_path / "inductor").rglob("*.py"))
    assert written, "Inductor wrote nothing under the cache root"
