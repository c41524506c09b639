"""Request priority in the engine (vLLM's convention: an int, lower is served earlier, default
0): the check at submission and the per-priority load the replica reports to gateways."""

from __future__ import annotations

from collections.abc import Iterable

from backend_engine.errors import InvalidRequestError
from backend_engine.sequence import Sequence


def check_priority(priority: object) -> None:
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequestError(f"priority must be an integer, got {priority!r}",
                                  param="priority", code="invalid_value")


def load_by_priority(running: Iterable[Sequence], waiting: Iterable[Sequence]) -> dict[str, dict]:
    """{"<priority>": {"running", "waiting", "pending_prefill_tokens"}} over the sequences in
    the queues, so a gateway can count only the work that competes with a request."""
    out: dict[str, dict] = {}

    def row(seq: Sequence) -> dict:
        key = str(seq.priority)
        entry = out.get(key)
        if entry is None:
            entry = out[key] = {"running": 0, "waiting": 0, "pending_prefill_tokens": 0}
        return entry

    for seq in running:
        entry = row(seq)
        entry["running"] += 1
        entry["pending_prefill_tokens"] += max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
    for seq in waiting:
        entry = row(seq)
        entry["waiting"] += 1
        entry["pending_prefill_tokens"] += seq.num_tokens - seq.num_computed_tokens
    return out
