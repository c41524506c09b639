"""kvgate's engine replica: paged KV cache, prefix caching, continuous batching."""

import os

# OpenMP threads that spin at barriers collapse (25x slower steps, measured) when another
# process holds a core; sleeping waiters cost a little and never collapse. Must be set before
# torch loads libgomp, and importing this package comes first.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
