"""`POST /v1/responses`: the Responses API over the chat path (the request becomes a chat
completion: same template, tools, grammar and parser), answered as a `response` object or as
its stream of events (created, output items and their deltas, completed)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from starlette.requests import Request

from backend_engine.outputs import RequestOutput
from backend_engine.server.auth import require_api_key
from backend_engine.server.chat import plan_tools, render_prompt, with_plan
from backend_engine.server.chat_stream import chat_chunks
from backend_engine.server.generation import Started
from backend_engine.server.reasoning_plan import ReasoningPlan
from backend_engine.server.sampling import chat_sampling_params
from backend_engine.server.serving import ResponseMeta, serve_generation
from backend_engine.server.state import ServerState
from backend_engine.server.tool_plan import ToolPlan
from protocol.parsing import parse_request
from protocol.response_events import ResponseEvents, finish_response, item_id, response_skeleton
from protocol.response_objects import (FunctionCallItem, OutputMessage, OutputText, ReasoningItem,
                                       ReasoningText, ResponseObject, ResponseUsage)
from protocol.responses import ResponsesRequest

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = parse_request(ResponsesRequest, await request.body())
    engine = state.ready_engine()
    model = state.check_model(req.model)
    chat = req.to_chat()
    plan = plan_tools(state, chat, "text.format.schema")
    if req.max_tool_calls is not None:
        plan.max_calls = min(plan.max_calls or req.max_tool_calls, req.max_tool_calls)
    prompt = render_prompt(engine, chat, "input")
    thinking = ReasoningPlan.build(state.reasoning_parser, engine.tokenizer, prompt)
    params = thinking.constrain(with_plan(chat_sampling_params(chat), plan))
    meta = ResponseMeta.new("resp", model, req.request_id or request.headers.get("x-request-id"))
    view = _View(meta, req, plan, thinking)
    return await serve_generation(
        request, state, meta, [prompt], params, req.cache_salt, bool(req.stream),
        view.stream, lambda outputs: view.final(outputs[0]), priority=req.priority or 0)


class _View:
    """One request's outputs as a response object and as its events."""

    def __init__(self, meta: ResponseMeta, req: ResponsesRequest, plan: ToolPlan,
                 thinking: ReasoningPlan):
        self.meta, self.req, self.plan, self.thinking = meta, req, plan, thinking

    def skeleton(self) -> ResponseObject:
        return response_skeleton(self.req, self.meta.id, self.meta.created, self.meta.model)

    def final(self, out: RequestOutput) -> ResponseObject:
        c = out.outputs[0]
        reasoning, text = self.thinking.split(c.text)
        content, calls, _ = self.plan.answer(text or "", c.finish_reason)
        status = "incomplete" if c.finish_reason == "length" else "completed"
        response = self.skeleton()
        if reasoning:
            done = "incomplete" if status == "incomplete" and not content and not calls \
                else "completed"
            response.output.append(ReasoningItem(id=item_id("rs"), status=done,
                                                 content=[ReasoningText(text=reasoning)]))
        if content:
            response.output.append(OutputMessage(id=item_id("msg"), status=status,
                                                 content=[OutputText(text=content)]))
        for call in calls:
            response.output.append(FunctionCallItem(
                id=item_id("fc"), call_id=call.id, name=call.function.name,
                arguments=call.function.arguments, status="completed"))
        usage = ResponseUsage.of(len(out.prompt_token_ids), len(c.token_ids), out.num_cached_tokens)
        return finish_response(response, c.finish_reason, usage)

    async def stream(self, started: list[Started]) -> AsyncIterator[bytes]:
        """The chat stream's chunks, translated (protocol/response_events.py)."""
        events = ResponseEvents(self.skeleton())
        for frame in events.start():
            yield frame
        async for chunk in chat_chunks(self.meta, started, 1, None, True, False, self.plan,
                                       self.thinking):
            for frame in events.feed(chunk):
                yield frame
        for frame in events.close():
            yield frame
