"""kvgate's engine replica: paged KV cache, prefix caching, continuous batching."""
