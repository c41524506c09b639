"""The request flow both generation endpoints share: admit, start the engine requests, then
either stream or wait for the final outputs — aborting the moment the client leaves."""

from __future__ import annotations

import importlib.metadata
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.requests import Request

from backend_engine.errors import EngineDeadError, EngineError
from backend_engine.outputs import RequestOutput
from backend_engine.sampling_params import SamplingParams
from backend_engine.server import disagg
from backend_engine.server.generation import (
    RequestAborted,
    Started,
    close_all,
    final_outputs,
    start_generations,
)
from backend_engine.server.sampling import engine_error_to_api
from backend_engine.server.state import ServerState
from protocol.anthropic_errors import stream_error
from protocol.disconnect import CLIENT_CLOSED_REQUEST, ClientDisconnected, unless_disconnected
from protocol.errors import APIError, service_unavailable
from protocol.kv_transfer import KVTransferParams
from protocol.sse import EventStreamResponse
from protocol.usage_headers import usage_headers

logger = logging.getLogger(__name__)
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,256}$")


def _version() -> str:
    try:
        return importlib.metadata.version("kvgate")
    except importlib.metadata.PackageNotFoundError:
        return "dev"


SYSTEM_FINGERPRINT = f"fp_kvgate_{_version()}"


@dataclass(slots=True)
class ResponseMeta:
    """What every response object and chunk of one request repeats."""

    id: str
    created: int
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT

    @classmethod
    def new(cls, prefix: str, model: str, client_request_id: str | None) -> "ResponseMeta":
        ok = client_request_id is not None and _SAFE_ID.match(client_request_id)
        suffix = client_request_id if ok else secrets.token_hex(16)
        return cls(id=f"{prefix}-{suffix}", created=int(time.time()), model=model)


def aborted_error() -> APIError:
    return service_unavailable("The request was aborted because this replica is shutting down.", 1, "server_shutting_down")


def raise_if_aborted(outputs: list[RequestOutput]) -> None:
    if any(c.finish_reason == "abort" for out in outputs for c in out.outputs):
        raise aborted_error()


StreamRenderer = Callable[[list[Started]], AsyncIterator[bytes]]
FinalRenderer = Callable[[list[RequestOutput]], BaseModel]


async def serve_generation(
    request: Request,
    state: ServerState,
    meta: ResponseMeta,
    prompts: list[list[int]],
    params: SamplingParams,
    cache_salt: str | None,
    stream: bool,
    render_stream: StreamRenderer,
    render_final: FinalRenderer,
    priority: int = 0,
    kv_transfer: KVTransferParams | None = None,
) -> Response:
    if kv_transfer is not None:  # one half of a prefill/decode pair
        disagg.check_request(kv_transfer, len(prompts), stream)
        if kv_transfer.do_remote_decode:
            try:
                return await disagg.serve_prefill_half(request, state, meta, prompts[0], params, cache_salt,
                                                       priority, kv_transfer, render_final)
            except (APIError, ClientDisconnected):
                raise
            except Exception as exc:
                raise _to_api_error(state, exc) from None
    engine = state.ready_engine()
    # Engine ids stay unique even when clients reuse their own request_id.
    request_ids = [f"{meta.id}-{secrets.token_hex(4)}" for _ in prompts]
    headers = {"x-request-id": meta.id}
    for rid in request_ids:
        state.admit(rid, meta.id)

    def release() -> None:
        for rid in request_ids:
            state.release(rid)

    try:
        starting = start_generations(engine, prompts, params, request_ids, cache_salt, state.abort_in_flight,
                                     priority, disagg.engine_params(kv_transfer))
        started = await unless_disconnected(request, starting)
    except ClientDisconnected:
        release()
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except BaseException as exc:
        release()
        if isinstance(exc, Exception):
            raise _to_api_error(state, exc) from None
        raise

    # the prompts' usage is known with their first outputs: in the headers for proxies
    headers.update(usage_headers(sum(len(s.first.prompt_token_ids) for s in started),
                                 sum(s.first.num_cached_tokens for s in started)))
    if stream:

        async def on_close() -> None:
            await close_all(started)
            release()

        return EventStreamResponse(_guarded(render_stream(started), state, request.url.path), headers=headers,
                                   on_close=on_close)

    try:
        finals = await unless_disconnected(request, final_outputs(started))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except Exception as exc:
        raise _to_api_error(state, exc) from None
    finally:
        await close_all(started)
        release()
    raise_if_aborted(finals)
    return JSONResponse(render_final(finals).model_dump(mode="json"), headers=headers)


async def _guarded(body: AsyncIterator[bytes], state: ServerState, path: str) -> AsyncIterator[bytes]:
    """After the headers went out an error is one error event (then `[DONE]` for OpenAI's APIs)."""
    try:
        async for chunk in body:
            yield chunk
    except Exception as exc:
        yield stream_error(_to_api_error(state, exc), path)


def _to_api_error(state: ServerState, exc: Exception) -> APIError:
    if isinstance(exc, RequestAborted):
        return aborted_error()
    if isinstance(exc, EngineDeadError):
        state.mark_dead(str(exc) or "engine loop died")
    if not isinstance(exc, (APIError, EngineError)):
        logger.exception("generation failed", exc_info=exc)
    return engine_error_to_api(exc, state.settings.retry_after_s)
