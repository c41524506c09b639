"""Speculative decoding: proposers (n-gram, draft model), lossless verification, the switch."""
