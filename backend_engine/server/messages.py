"""`POST /v1/messages` and `/v1/messages/count_tokens` (Anthropic's Messages API) over the chat
path: the request becomes a chat completion (same template, tools, grammar and parser, same
prompt tokens and block hashes), and the chat answer or its chunks become a Message or its
events (protocol/anthropic_chat.py, protocol/anthropic_stream.py)."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from starlette.requests import Request

from backend_engine.outputs import RequestOutput
from backend_engine.server.auth import require_api_key
from backend_engine.server.chat import (chat_completion, plan_tools, render_prompt, render_tokens,
                                        with_plan)
from backend_engine.server.chat_stream import chat_chunks
from backend_engine.server.generation import Started
from backend_engine.server.reasoning_plan import ReasoningPlan
from backend_engine.server.sampling import chat_sampling_params
from backend_engine.server.serving import ResponseMeta, serve_generation
from backend_engine.server.state import ServerState
from protocol.anthropic import CountTokensRequest, CountTokensResponse, Message, MessagesRequest
from protocol.anthropic_chat import message_of, to_chat
from protocol.anthropic_stream import MessageEvents
from protocol.parsing import parse_request

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = parse_request(MessagesRequest, await request.body())
    engine = state.ready_engine()
    model = state.check_model(req.model)
    chat = to_chat(req, stream_usage=True)
    plan = plan_tools(state, chat)
    prompt = render_prompt(engine, chat)
    thinking = ReasoningPlan.build(state.reasoning_parser, engine.tokenizer, prompt,
                                   chat.include_reasoning)
    params = thinking.constrain(with_plan(chat_sampling_params(chat), plan))
    meta = ResponseMeta(id=f"msg_{secrets.token_hex(12)}", created=int(time.time()), model=model)

    async def render_stream(started: list[Started]) -> AsyncIterator[bytes]:
        events = MessageEvents(meta.id, meta.model, req.stop_sequences)
        async for chunk in chat_chunks(meta, started, 1, None, True, True, plan, thinking):
            for frame in events.feed(chunk):
                yield frame
        for frame in events.close():
            yield frame

    def render_final(outputs: list[RequestOutput]) -> Message:
        return message_of(chat_completion(meta, outputs[0], None, plan, thinking),
                          req.stop_sequences)

    return await serve_generation(
        request, state, meta, [prompt], params, chat.cache_salt, bool(req.stream), render_stream,
        render_final, priority=chat.priority or 0)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> CountTokensResponse:
    state: ServerState = request.app.state.server
    req = parse_request(CountTokensRequest, await request.body())
    engine = state.ready_engine()
    state.check_model(req.model)
    return CountTokensResponse(input_tokens=len(render_tokens(engine, to_chat(req))))
