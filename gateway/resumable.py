"""Which requests may migrate mid-stream, and the bodies their legs send: the first asks a
kvgate replica for token ids (`return_token_ids`), a continuation resumes from them
(`resume_token_ids`) with the original request's sampling, seed and max_tokens (the resumed
tokens count against it). Every leg streams chat (or completions) chunks; a request of another
API (chat_rendered.py) names the chat path its legs take and renders the spliced chunks."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass


@dataclass(slots=True)
class Resumable:
    """A streamed chat or completions request with one sample: it may migrate."""
    data: dict  # the body as forwarded, parsed
    include_usage: bool
    keep_token_ids: bool  # the client asked for return_token_ids itself
    path: str | None = None  # where the legs go, when not the request's own path
    # the spliced chunks → the client's events (None: the chunks as they are)
    render: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]] | None = None

    def first_body(self) -> bytes:
        """What a replica that can resume gets: the body asking for token ids."""
        return _dump({**self.data, "return_token_ids": True})

    def continuation_body(self, token_ids: list[int]) -> bytes:
        return _dump({**self.data, "return_token_ids": True, "resume_token_ids": token_ids})


def resumable(data: dict, n: int, single_prompt: bool, stream: bool,
              include_usage: bool) -> Resumable | None:
    """A chat or completions request's migration, when it may have one."""
    if not stream or n != 1 or not single_prompt or data.get("resume_token_ids") is not None:
        return None
    return Resumable(data, include_usage, bool(data.get("return_token_ids")))


def _dump(data: dict) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()
