"""The client's side of a migrating stream: reads a kvgate replica's SSE events (asked with
`return_token_ids`), passes each engine output's chunks on only once the chunk carrying its
token ids has arrived, and so always knows exactly which generated tokens the client holds the
text of. A continuation's stream (another replica, `resume_token_ids`) is spliced in: its role
chunk dropped, its id and creation time made the first leg's."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from protocol.sse import DONE

SHUTTING_DOWN = "server_shutting_down"  # a replica's error event when its drain ran out


class ReplicaErrorEvent(Exception):
    """The replica sent an error event inside its 200 stream."""

    def __init__(self, error: dict) -> None:
        super().__init__(str(error.get("message") or error))
        self.code = error.get("code")


@dataclass(slots=True)
class StreamSplice:
    keep_token_ids: bool  # the client asked for return_token_ids itself
    include_usage: bool  # the client asked for a usage chunk
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)  # generated and passed on to the client
    finished: bool = False  # the client has its finish_reason
    usage_sent: bool = False
    usage: dict | None = None  # the last usage chunk (each leg's counts every token)
    done: bool = False  # [DONE] passed on
    leg: int = 0  # 0: the first replica; k: the k-th continuation
    _identity: dict | None = None  # the first leg's id, object, created, model
    _pending: list[bytes] = field(default_factory=list)  # this output's chunks, not yet sent
    _partial: bytes = b""

    def next_leg(self) -> None:
        """The current replica's stream broke: what it had not finished sending is dropped."""
        self.leg += 1
        self._pending.clear()
        self._partial = b""

    def feed(self, data: bytes) -> list[bytes]:
        """Bytes from the replica → events to send the client now."""
        events = (self._partial + data).split(b"\n\n")
        self._partial = events.pop()
        out: list[bytes] = []
        for event in events:
            out += self._event(event)
        return out

    def _event(self, raw: bytes) -> list[bytes]:
        if not raw.startswith(b"data: "):
            return []  # comments and keep-alives: nothing for the client
        if raw == DONE.rstrip():
            self.done = True
            return [*self._flush(), DONE]
        try:
            payload = json.loads(raw[6:])
        except ValueError:
            return []
        if isinstance(payload, dict) and "error" in payload:
            raise ReplicaErrorEvent(payload["error"] if isinstance(payload["error"], dict) else {})
        choices = payload.get("choices") or []
        if self._identity is None:
            self._identity = {k: payload.get(k) for k in ("id", "object", "created", "model")}
        rewrite = self.leg > 0
        if not choices:  # the usage chunk
            self.usage_sent, self.usage = True, payload
            return [*self._flush(), self._dump(payload) if rewrite else raw + b"\n\n"]
        choice = choices[0]
        if (choice.get("delta") or {}).get("role") and "token_ids" not in choice:
            return [] if rewrite else [raw + b"\n\n"]  # the role chunk: once, from the first leg
        if choice.get("finish_reason"):
            self.finished = True
        if "token_ids" not in choice:
            self._pending.append(self._dump(payload) if rewrite else raw + b"\n\n")
            return []
        self.token_ids += choice["token_ids"] or []
        if not self.keep_token_ids:
            del choice["token_ids"]
            if _carries_nothing(choice):  # only there for its ids: the client never sees it
                return self._flush()
            rewrite = True
        event = self._dump(payload) if rewrite else raw + b"\n\n"
        return [*self._flush(), event]

    def _flush(self) -> list[bytes]:
        out, self._pending = self._pending, []
        return out

    def _dump(self, payload: dict) -> bytes:
        payload.update({k: v for k, v in (self._identity or {}).items() if v is not None})
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    def closing_events(self) -> list[bytes]:
        """The end of a stream whose finish_reason the client already has (the replica broke
        after it): the usage chunk it asked for, counted by the gateway, then [DONE]."""
        out: list[bytes] = []
        if self.include_usage and not self.usage_sent:
            completion = len(self.token_ids)
            usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                     "total_tokens": self.prompt_tokens + completion}
            out.append(self._dump({"choices": [], "usage": usage}))
        if not self.done:
            out.append(DONE)
        return out


def _carries_nothing(choice: dict) -> bool:
    """A chunk a replica sends only to carry the ids of tokens whose text it holds back."""
    delta = choice.get("delta")
    empty = delta == {"content": ""} if delta is not None else choice.get("text") == ""
    return empty and not choice.get("finish_reason") and not choice.get("logprobs")
