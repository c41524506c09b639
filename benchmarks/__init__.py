"""Reproducible benchmarks; each ends with one line of JSON."""

import os

# See backend_engine/__init__.py: spinning OpenMP waiters collapse on a shared machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
