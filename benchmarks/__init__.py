"""Reproducible benchmarks; each ends with one line of JSON."""

import backend_engine  # noqa: F401 - sets the OpenMP wait policy before torch loads libgomp
