"""Where a replica publishes KV events over ZMQ: `--kv-events tcp://HOST:5557[,replay=tcp://HOST:5558]
[,topic=T][,dp_size=N]`, given after the `--replica URL` it belongs to (or `kv_events:` on a
replica entry of the config file). With `dp_size=N` the engine runs N data-parallel ranks and,
as vLLM does, rank r publishes on the endpoint's port + r (and its replay port + r)."""

from __future__ import annotations

from dataclasses import dataclass

OPTIONS = ("replay", "topic", "dp_size")


class KvEventsSpecError(ValueError):
    """The --kv-events value cannot be used."""


@dataclass(frozen=True, slots=True)
class KvEventsSpec:
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    dp_size: int = 1

    def ranks(self) -> list[tuple[int, str, str | None]]:
        """(rank, endpoint, replay endpoint) of every data-parallel rank."""
        return [(r, _offset(self.endpoint, r), _offset(self.replay_endpoint, r))
                for r in range(self.dp_size)]

    def __str__(self) -> str:
        parts = [self.endpoint]
        if self.replay_endpoint:
            parts.append(f"replay={self.replay_endpoint}")
        if self.topic:
            parts.append(f"topic={self.topic}")
        if self.dp_size != 1:
            parts.append(f"dp_size={self.dp_size}")
        return ",".join(parts)


def parse_kv_events(value: str) -> KvEventsSpec:
    endpoint, *options = [p.strip() for p in value.split(",")]
    _check_endpoint(endpoint, "endpoint")
    found: dict[str, str] = {}
    for option in options:
        name, sep, val = option.partition("=")
        if not sep or name not in OPTIONS:
            raise KvEventsSpecError(f"--kv-events: unknown option {option!r}; "
                                    f"use {', '.join(o + '=…' for o in OPTIONS)}")
        found[name] = val
    replay = found.get("replay") or None
    if replay is not None:
        _check_endpoint(replay, "replay")
    try:
        dp_size = int(found.get("dp_size", "1"))
    except ValueError:
        dp_size = 0
    if not 1 <= dp_size <= 64:
        raise KvEventsSpecError("--kv-events: dp_size must be an integer in [1, 64]")
    if dp_size > 1 and not endpoint.startswith("tcp://"):
        raise KvEventsSpecError("--kv-events: dp_size > 1 needs tcp:// endpoints (ports are offset by rank)")
    return KvEventsSpec(endpoint, replay, found.get("topic", ""), dp_size)


def _check_endpoint(endpoint: str, what: str) -> None:
    if endpoint.startswith("ipc://") and len(endpoint) > 6:
        return
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not host or not port.isdigit() \
            or not 0 < int(port) < 65536 or "*" in host:
        raise KvEventsSpecError(f"--kv-events: {what} {endpoint!r} must be tcp://HOST:PORT "
                                "(the engine's address, not its bind address) or ipc://PATH")


def _offset(endpoint: str | None, rank: int) -> str | None:
    if endpoint is None or rank == 0:
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"
