"""Reproducible benchmarks; each ends with one line of JSON."""

from backend_engine.process_env import set_process_defaults

# Every benchmark is a process entry point that may run the engine: its OpenMP spin count must
# be set before torch loads libgomp, which the benchmark modules import at their top.
set_process_defaults()
