"""The replica's half of a prefill/decode pair, as the gateway asks for it in
`kv_transfer_params` (protocol/kv_transfer.py).

The decode half is an ordinary generation that starts from the given first tokens, so it goes
through serve_generation like any request. The prefill half is answered here: run the prompt to
its first token(s) while the blocks stream to the decode replica, then answer once the decode
replica has them - or with a 503 `kv_transfer_failed` as soon as the transfer fails, so the
gateway can move the request elsewhere before anything reached its client."""

from __future__ import annotations

import asyncio
import secrets

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from backend_engine.kv_transfer.base import TransferResult
from backend_engine.kv_transfer.params import FirstToken, RemoteDecode, RemotePrefill
from backend_engine.outputs import RequestOutput
from backend_engine.sampling_params import SamplingParams
from backend_engine.server.generation import RequestAborted, final_outputs, start_generations
from protocol.disconnect import CLIENT_CLOSED_REQUEST, ClientDisconnected, unless_disconnected
from protocol.errors import bad_request, service_unavailable
from protocol.kv_transfer import KVTransferParams


def check_request(params: KVTransferParams, num_prompts: int, stream: bool) -> None:
    if num_prompts != 1:
        raise bad_request("kv_transfer_params takes exactly one prompt.", "kv_transfer_params",
                          "invalid_value")
    if params.do_remote_decode and stream:
        raise bad_request("The prefill half of a P/D pair is never streamed.", "stream",
                          "invalid_value")


def engine_params(params: KVTransferParams | None) -> RemoteDecode | RemotePrefill | None:
    if params is None:
        return None
    if params.do_remote_decode:
        return RemoteDecode(params.transfer_id, params.remote_address, params.remote_cached_blocks)
    return RemotePrefill([FirstToken(t.token_id, t.logprob,
                                     [(x.token_id, x.logprob) for x in t.top_logprobs or ()])
                          for t in params.first_tokens], params.transfer_id, params.cached_tokens)


def answer_params(remote: RemoteDecode, out: RequestOutput, result: TransferResult) -> dict:
    """What the prefill half tells the gateway, for the decode half's kv_transfer_params."""
    first = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        token = {"token_id": c.token_ids[0]}
        if c.logprobs:
            lp = c.logprobs[0]
            token["logprob"] = lp.logprob
            token["top_logprobs"] = [{"token_id": t, "logprob": v} for t, _, v in lp.top]
        first.append(token)
    return {"do_remote_decode": True, "transfer_id": remote.transfer_id,
            "first_tokens": first, "cached_tokens": out.num_cached_tokens,
            "transfer": result.to_dict()}


async def serve_prefill_half(request: Request, state, meta, prompt: list[int],  # noqa: ANN001
                             params: SamplingParams, cache_salt: str | None, priority: int,
                             kv: KVTransferParams, render_final) -> Response:  # noqa: ANN001
    engine = state.ready_engine()
    remote = engine_params(kv)
    request_id = f"{meta.id}-{secrets.token_hex(4)}"
    state.admit(request_id)

    async def run() -> tuple[RequestOutput, TransferResult]:
        started = await start_generations(engine, [prompt], params, [request_id], cache_salt,
                                          state.abort_in_flight, priority, remote)
        generating = asyncio.ensure_future(final_outputs(started))
        transfer = asyncio.wrap_future(remote.result)
        try:
            await asyncio.wait({generating, transfer}, return_when=asyncio.FIRST_COMPLETED)
            if transfer.done() and not transfer.result().ok:
                return None, transfer.result()  # no point computing on: answer at once
            finals = await generating
            return finals[0], await transfer
        finally:
            generating.cancel()
            await asyncio.gather(generating, return_exceptions=True)

    try:
        out, result = await unless_disconnected(request, run())
    except ClientDisconnected:  # the gateway gave up on this pair: so does the transfer
        await engine.abort_kv_transfer(remote.transfer_id)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except BaseException:  # serve_generation turns engine errors into OpenAI errors
        await engine.abort_kv_transfer(remote.transfer_id)
        raise
    finally:
        state.release(request_id)
    if not result.ok:
        raise service_unavailable(f"The KV transfer to the decode replica failed "
                                  f"({result.error_code}): {result.error}", None,
                                  "kv_transfer_failed")
    if any(c.finish_reason == "abort" for c in out.outputs):
        raise RequestAborted()
    payload = render_final([out]).model_dump(mode="json")
    payload["kv_transfer_params"] = answer_params(remote, out, result)
    return JSONResponse(payload, headers={"x-request-id": meta.id})
