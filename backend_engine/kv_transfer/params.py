"""What a request carries when its prefill and its decode run on different replicas."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from backend_engine.errors import InvalidRequestError
from backend_engine.kv_transfer.base import TransferResult


@dataclass(slots=True)
class FirstToken:
    """A token the prefill replica sampled, with its logprob data when the request asked."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob)


@dataclass(slots=True)
class RemoteDecode:
    """Prefill side: compute the prompt, sample each sample's first token and stop; send the
    prompt's full blocks the decode replica at `address` lacks."""

    transfer_id: str
    address: str
    hint: int = 0  # leading blocks the gateway believes the decode replica holds
    result: Future[TransferResult] = field(default_factory=Future)


@dataclass(slots=True)
class RemotePrefill:
    """Decode side: the prompt was prefilled elsewhere, which sampled these first tokens (one
    per sample); `transfer_id` names the blocks that transfer left held here."""

    first_tokens: list[FirstToken]
    transfer_id: str | None = None
    cached_tokens: int = 0  # prompt tokens the prefill replica served from its cache


def check_kv_transfer(kv_transfer: RemoteDecode | RemotePrefill | None, params,  # noqa: ANN001
                      vocab_size: int, connector=None) -> None:  # noqa: ANN001
    """Refuse, before anything is queued, a P/D half this replica cannot serve as given."""
    if isinstance(kv_transfer, RemoteDecode) and (connector is None or connector.exports is None):
        raise InvalidRequestError("this replica does not send KV blocks (start it with "
                                  "--kv-transfer-config '{\"kv_role\": \"kv_producer\"}')",
                                  param="kv_transfer_params",
                                  code="wrong_role")
    if isinstance(kv_transfer, RemotePrefill):
        tokens = kv_transfer.first_tokens
        ids = [t.token_id for t in tokens] + [i for t in tokens for i, _ in t.top]
        if len(tokens) != params.n or any(not 0 <= i < vocab_size for i in ids):
            raise InvalidRequestError(f"kv_transfer_params needs one first token per sample "
                                      f"(n={params.n}), each in [0, {vocab_size})",
                                      param="kv_transfer_params", code="invalid_value")
