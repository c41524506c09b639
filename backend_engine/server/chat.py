"""`POST /v1/chat/completions`: render the conversation with the model's chat template, generate,
and answer as one `chat.completion` or as `chat.completion.chunk` events."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from starlette.requests import Request

from backend_engine.errors import InvalidRequestError
from backend_engine.outputs import RequestOutput
from backend_engine.server.auth import require_api_key
from backend_engine.server.generation import Started, merged
from backend_engine.server.logprobs import chat_logprobs
from backend_engine.server.sampling import chat_sampling_params, check_context_length, engine_error_to_api
from backend_engine.server.serving import ResponseMeta, aborted_error, serve_generation
from backend_engine.server.state import ServerState
from kvgate.protocol.chat import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    DeltaMessage,
)
from kvgate.protocol.common import Usage
from kvgate.protocol.parsing import parse_request
from kvgate.protocol.sse import DONE, sse_data

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = parse_request(ChatCompletionRequest, await request.body())
    engine = state.ready_engine()
    model = state.check_model(req.model)
    try:
        prompt = engine.render_chat(
            req.template_messages(),
            add_generation_prompt=req.add_generation_prompt is not False,
            chat_template_kwargs=req.chat_template_kwargs,
            tools=req.tools,  # only with tool_choice "none": shown to the model, never called
            continue_final_message=bool(req.continue_final_message),
        )
    except InvalidRequestError as exc:
        raise engine_error_to_api(exc) from None
    check_context_length(len(prompt), req.max_output_tokens, engine.max_model_len, "messages")
    params = chat_sampling_params(req)
    meta = ResponseMeta.new("chatcmpl", model, req.request_id or request.headers.get("x-request-id"))
    n = params.n

    def render_stream(started: list[Started]) -> AsyncIterator[bytes]:
        return chat_stream(meta, started, n, req.num_logprobs, req.include_usage, _continuous_usage(req))

    def render_final(outputs: list[RequestOutput]) -> ChatCompletion:
        return chat_completion(meta, outputs[0], req.num_logprobs)

    return await serve_generation(
        request, state, meta, [prompt], params, req.cache_salt, bool(req.stream), render_stream, render_final,
        priority=req.priority or 0, kv_transfer=req.kv_transfer_params,
    )


def _continuous_usage(req: ChatCompletionRequest) -> bool:
    return bool(req.include_usage and req.stream_options and req.stream_options.continuous_usage_stats)


def usage_of(out: RequestOutput) -> Usage:
    completion = sum(len(c.token_ids) for c in out.outputs)
    return Usage.of(len(out.prompt_token_ids), completion, out.num_cached_tokens)


def chat_completion(meta: ResponseMeta, out: RequestOutput, num_top: int | None) -> ChatCompletion:
    choices = [
        ChatChoice(
            index=c.index,
            message=AssistantMessage(content=c.text),
            logprobs=chat_logprobs(c.logprobs, num_top) if num_top is not None else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in sorted(out.outputs, key=lambda c: c.index)
    ]
    return ChatCompletion(
        id=meta.id, created=meta.created, model=meta.model, system_fingerprint=meta.system_fingerprint,
        choices=choices, usage=usage_of(out),
    )


async def chat_stream(meta: ResponseMeta, started: list[Started], n: int, num_top: int | None,
                      include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[bytes]:
    """Role delta per choice, content deltas, a finish chunk per choice, [usage chunk], [DONE]."""
    dump = {} if include_usage else {"exclude": {"usage"}}
    usage: Usage | None = None

    def chunk(choices: list[ChatChunkChoice], final_usage: Usage | None = None) -> bytes:
        c = ChatCompletionChunk(
            id=meta.id, created=meta.created, model=meta.model, system_fingerprint=meta.system_fingerprint,
            choices=choices, usage=final_usage or (usage if continuous_usage else None),
        )
        return sse_data(c, **dump)

    for index in range(n):
        yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
    finished: set[int] = set()
    async for _, out in merged(started):
        usage = usage_of(out)
        for c in out.outputs:
            if c.index in finished:
                continue
            if c.delta_text or (num_top is not None and c.delta_logprobs):
                logprobs = chat_logprobs(c.delta_logprobs, num_top) if num_top is not None else None
                yield chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(content=c.delta_text), logprobs=logprobs)])
            if c.finish_reason is not None:
                finished.add(c.index)
                if c.finish_reason == "abort":
                    raise aborted_error()
                finish = ChatChunkChoice(index=c.index, delta=DeltaMessage(), finish_reason=c.finish_reason,
                                         stop_reason=c.stop_reason)
                yield chunk([finish])
    if include_usage and usage is not None:
        yield chunk([], usage)
    yield DONE
