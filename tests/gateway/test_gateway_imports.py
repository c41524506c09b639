"""The gateway never loads torch or the engine: importing its app and its server (all that
`kvgate gateway` runs) leaves them out of the process."""

import subprocess
import sys

HEAVY = ("torch", "transformers", "triton", "backend_engine")


def test_importing_the_gateway_app_loads_no_torch_and_no_engine():
    code = (f"import sys, gateway.app, gateway.serve; "
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120).stdout.strip()
    assert out == "[]"
