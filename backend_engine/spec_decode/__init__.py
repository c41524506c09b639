"""Speculative decoding: proposers (n-gram, draft model) and the switch; the runner verifies the
drafts (rejection_sampler.py)."""
