"""The replica's OpenAI-compatible HTTP server over the async engine (see docs/api/index.md)."""
