"""`POST /v1/responses`: the Responses API over the chat path (the request becomes a chat
completion: same template, tools, grammar and parser), answered as a `response` object or as
its stream of events (created, output items and their deltas, completed)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from starlette.requests import Request

from backend_engine.outputs import RequestOutput
from backend_engine.server.auth import require_api_key
from backend_engine.server.chat import plan_tools, render_prompt, with_plan
from backend_engine.server.generation import Started, merged
from backend_engine.server.reasoning_plan import ReasoningPlan
from backend_engine.server.sampling import chat_sampling_params
from backend_engine.server.serving import ResponseMeta, aborted_error, serve_generation
from backend_engine.server.state import ServerState
from backend_engine.server.tool_plan import ToolPlan, new_call_id
from protocol.parsing import parse_request
from protocol.response_objects import (EventWriter, FunctionCallItem, IncompleteDetails,
                                       OutputMessage, OutputText, ReasoningItem, ReasoningText,
                                       ResponseObject, ResponseUsage)
from protocol.responses import ResponsesRequest

router = APIRouter(dependencies=[Depends(require_api_key)])
TextItem = OutputMessage | ReasoningItem  # the output items that hold text


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


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class _View:
    """One request's outputs as a response object and as its events."""

    def __init__(self, meta: ResponseMeta, req: ResponsesRequest, plan: ToolPlan,
                 thinking: ReasoningPlan):
        self.meta, self.req, self.plan, self.thinking = meta, req, plan, thinking

    def skeleton(self, status: str = "in_progress") -> ResponseObject:
        req = self.req
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) \
            if req.text and req.text.format else {"type": "text"}
        choice = req.tool_choice
        return ResponseObject(
            id=self.meta.id, created_at=self.meta.created, status=status, model=self.meta.model,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls is not False, reasoning=req.reasoning,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, text={"format": fmt},
            tool_choice=choice.model_dump() if hasattr(choice, "model_dump") else (choice or "auto"),
            tools=[t.model_dump(exclude_none=True) for t in req.functions],
            truncation=req.truncation or "disabled", user=req.user, metadata=req.metadata or {})

    def finished(self, response: ResponseObject, out: RequestOutput) -> ResponseObject:
        c = out.outputs[0]
        response.usage = ResponseUsage.of(len(out.prompt_token_ids), len(c.token_ids),
                                          out.num_cached_tokens)
        response.status = "incomplete" if c.finish_reason == "length" else "completed"
        if c.finish_reason == "length":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        return response

    def final(self, out: RequestOutput) -> ResponseObject:
        c = out.outputs[0]
        reasoning, text = self.thinking.split(c.text)
        content, calls, _ = self.plan.answer(text or "", c.finish_reason)
        status = "incomplete" if c.finish_reason == "length" else "completed"
        response = self.skeleton()
        if reasoning:
            done = "incomplete" if status == "incomplete" and not content and not calls \
                else "completed"
            response.output.append(ReasoningItem(id=_item_id("rs"), status=done,
                                                 content=[ReasoningText(text=reasoning)]))
        if content:
            response.output.append(OutputMessage(id=_item_id("msg"), status=status,
                                                 content=[OutputText(text=content)]))
        for call in calls:
            response.output.append(FunctionCallItem(
                id=_item_id("fc"), call_id=call.id, name=call.function.name,
                arguments=call.function.arguments, status="completed"))
        return self.finished(response, out)

    async def stream(self, started: list[Started]) -> AsyncIterator[bytes]:
        event = EventWriter()
        response = self.skeleton()
        yield event("response.created", response=response)
        yield event("response.in_progress", response=response)
        message: OutputMessage | None = None
        thought: ReasoningItem | None = None
        reasoning_stream = self.thinking.stream()
        tools = self.plan.stream()
        num_calls = 0
        async for _, out in merged(started):
            c = out.outputs[0]
            if c.finish_reason == "abort":
                raise aborted_error()
            final = c.finish_reason is not None
            text = c.delta_text
            if reasoning_stream is not None:
                reasoning, text = reasoning_stream.feed(text, final)
                if reasoning:
                    frames, thought = self._add_text(event, response, thought, reasoning,
                                                     ReasoningItem)
                    for frame in frames:
                        yield frame
            content, calls = text, []
            if tools is not None:
                found = tools.feed(text, final)
                content, calls = found.content, self.plan.keep(found.calls, num_calls)
            if thought is not None and (content or calls or final):
                status = "incomplete" if c.finish_reason == "length" and not (content or calls) \
                    else "completed"
                for frame in self._close(event, response, thought, status):
                    yield frame
                thought = None
            if content:
                frames, message = self._add_text(event, response, message, content,
                                                 OutputMessage)
                for frame in frames:
                    yield frame
            for call in calls:
                if message is not None:
                    for frame in self._close(event, response, message, "completed"):
                        yield frame
                    message = None
                num_calls += 1
                for frame in self._function_call(event, response, call):
                    yield frame
            if final:
                status = "incomplete" if c.finish_reason == "length" else "completed"
                if message is not None:
                    for frame in self._close(event, response, message, status):
                        yield frame
                self.finished(response, out)
                yield event(f"response.{response.status}", response=response)

    @staticmethod
    def _add_text(event: EventWriter, response: ResponseObject, item: TextItem | None,
                  text: str, kind: type[TextItem]) -> tuple[list[bytes], TextItem]:
        """Frames adding `text` to `item` (an answer's message or the reasoning), opening a new
        item of `kind`, with its one text part, when there is none yet."""
        frames = []
        if item is None:
            prefix, empty = ("rs", ReasoningText(text="")) if kind is ReasoningItem \
                else ("msg", OutputText(text=""))
            item = kind(id=_item_id(prefix), status="in_progress")
            frames.append(event("response.output_item.added", output_index=len(response.output),
                                item=item))
            item.content.append(empty)
            response.output.append(item)
            frames.append(event("response.content_part.added", item_id=item.id,
                                output_index=len(response.output) - 1, content_index=0,
                                part=empty))
        part = item.content[0]
        part.text += text
        extra = {"logprobs": []} if kind is OutputMessage else {}
        frames.append(event(f"response.{part.type}.delta", item_id=item.id,
                            output_index=len(response.output) - 1, content_index=0, delta=text,
                            **extra))
        return frames, item

    @staticmethod
    def _close(event: EventWriter, response: ResponseObject, item: TextItem, status: str):
        index = response.output.index(item)
        part = item.content[0]
        item.status = status
        extra = {"logprobs": []} if isinstance(item, OutputMessage) else {}
        yield event(f"response.{part.type}.done", item_id=item.id, output_index=index,
                    content_index=0, text=part.text, **extra)
        yield event("response.content_part.done", item_id=item.id, output_index=index,
                    content_index=0, part=part)
        yield event("response.output_item.done", output_index=index, item=item)

    @staticmethod
    def _function_call(event: EventWriter, response: ResponseObject, call):  # noqa: ANN001
        item = FunctionCallItem(id=_item_id("fc"), call_id=new_call_id(), name=call.name,
                                arguments="", status="in_progress")
        index = len(response.output)
        yield event("response.output_item.added", output_index=index, item=item)
        response.output.append(item)
        yield event("response.function_call_arguments.delta", item_id=item.id,
                    output_index=index, delta=call.arguments)
        item.arguments, item.status = call.arguments, "completed"
        yield event("response.function_call_arguments.done", item_id=item.id,
                    output_index=index, name=call.name, arguments=call.arguments)
        yield event("response.output_item.done", output_index=index, item=item)
