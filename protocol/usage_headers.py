"""A kvgate replica's prompt usage in its response headers. A kvgate replica sends its status
line with the first output (after the prompt's prefill was scheduled and its prefix-cache hit
known), so the headers can carry the prompt's token count and how many of them came from the
cache: a proxy that routes by prefix (the endpoint picker behind Envoy) reads them there and
need not read the response body at all. The body's own `usage` says the same."""

from __future__ import annotations

from collections.abc import Mapping

PROMPT_TOKENS_HEADER = "x-kvgate-prompt-tokens"
CACHED_TOKENS_HEADER = "x-kvgate-cached-tokens"


def usage_headers(prompt_tokens: int, cached_tokens: int) -> dict[str, str]:
    return {PROMPT_TOKENS_HEADER: str(prompt_tokens), CACHED_TOKENS_HEADER: str(cached_tokens)}


def usage_from_headers(headers: Mapping[str, str]) -> tuple[int, int] | None:
    """(prompt tokens, cached tokens) from response headers (lower-case names); None when they
    are absent or not counts (a replica that is not kvgate's, or a proxy that mangled them)."""
    prompt, cached = headers.get(PROMPT_TOKENS_HEADER), headers.get(CACHED_TOKENS_HEADER)
    if prompt is None or cached is None or not prompt.isdigit() or not cached.isdigit():
        return None
    prompt_tokens, cached_tokens = int(prompt), int(cached)
    if cached_tokens > prompt_tokens:
        return None
    return prompt_tokens, cached_tokens
