"""`kv_transfer_params` (vLLM's field name): what the gateway adds to the two halves of a
prefill/decode pair. Clients never send it; the gateway refuses it from them.

Prefill half (`do_remote_decode`): compute the prompt, sample each sample's first token, send
the prompt's KV blocks the decode replica at `remote_address` lacks; answer (never streamed) with
the same field filled in: the first tokens, the cached tokens and the transfer's figures.
Decode half (`do_remote_prefill`): the prompt's blocks came with transfer `transfer_id`; continue
from `first_tokens` and stream as an ordinary response."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.errors import bad_request

TRANSFER_ID = r"^[A-Za-z0-9._:-]{1,128}$"
MAX_FIRST_TOKENS = 128  # one per sample: n's bound


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TopToken(_Strict):
    token_id: int = Field(ge=0)
    logprob: float = Field(le=0.0, allow_inf_nan=False)


class FirstTokenParam(_Strict):
    token_id: int = Field(ge=0)
    logprob: float | None = Field(default=None, le=0.0, allow_inf_nan=False)
    top_logprobs: list[TopToken] | None = Field(default=None, max_length=20)


class TransferFigures(BaseModel):
    blocks_needed: int = 0
    blocks_sent: int = 0
    bytes: int = 0
    seconds: float = 0.0


class KVTransferParams(_Strict):
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    transfer_id: str = Field(pattern=TRANSFER_ID)
    remote_address: str | None = Field(default=None, pattern=r"^tcp://[^\s/]+:\d{1,5}$")
    remote_cached_blocks: int = Field(default=0, ge=0)
    first_tokens: list[FirstTokenParam] | None = Field(default=None, max_length=MAX_FIRST_TOKENS)
    cached_tokens: int = Field(default=0, ge=0)
    transfer: TransferFigures | None = None  # in the prefill half's answer only

    @model_validator(mode="after")
    def _one_half(self) -> Any:
        if self.do_remote_decode == self.do_remote_prefill:
            raise bad_request("kv_transfer_params needs exactly one of 'do_remote_decode' and "
                              "'do_remote_prefill'.", "kv_transfer_params", "invalid_value")
        if self.do_remote_decode and self.remote_address is None:
            raise bad_request("kv_transfer_params.do_remote_decode needs 'remote_address'.",
                              "kv_transfer_params.remote_address", "missing_required_parameter")
        if self.do_remote_prefill and not self.first_tokens:
            raise bad_request("kv_transfer_params.do_remote_prefill needs 'first_tokens'.",
                              "kv_transfer_params.first_tokens", "missing_required_parameter")
        return self
