"""Chat completion chunks of one choice → the Responses API's stream: `response.created` and
`response.in_progress`, then per output item (reasoning, the message, each function call) its
`output_item.added`, content part, deltas and `done` events, then `response.completed` (or
`response.incomplete`) with usage. The replica streams `/v1/responses` through it, and a gateway
renders a migrated stream's spliced chunks with it, so both write the same events."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

from protocol.anthropic_chat import reasoning_of
from protocol.chat import ChatCompletionChunk
from protocol.common import Usage
from protocol.response_objects import (EventWriter, FunctionCallItem, IncompleteDetails,
                                       OutputMessage, OutputText, ReasoningItem, ReasoningText,
                                       ResponseObject, ResponseUsage)
from protocol.responses import ResponsesRequest

TextItem = OutputMessage | ReasoningItem  # the output items that hold text


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def response_skeleton(req: ResponsesRequest, response_id: str, created_at: int, model: str,
                      status: str = "in_progress") -> ResponseObject:
    """The response object as the request shapes it, before any output."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) \
        if req.text and req.text.format else {"type": "text"}
    choice = req.tool_choice
    return ResponseObject(
        id=response_id, created_at=created_at, status=status, model=model,
        instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls is not False, reasoning=req.reasoning,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, text={"format": fmt},
        tool_choice=choice.model_dump() if hasattr(choice, "model_dump") else (choice or "auto"),
        tools=[t.model_dump(exclude_none=True) for t in req.functions],
        truncation=req.truncation or "disabled", user=req.user, metadata=req.metadata or {})


def finish_response(response: ResponseObject, finish_reason: str | None,
                    usage: ResponseUsage | None) -> ResponseObject:
    response.usage = usage
    response.status = "incomplete" if finish_reason == "length" else "completed"
    if finish_reason == "length":
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
    return response


class ResponseEvents:
    """`start()`, then feed it each chunk, then `close()` when the chat stream ends."""

    def __init__(self, response: ResponseObject) -> None:
        self.event = EventWriter()
        self.response = response
        self.message: OutputMessage | None = None
        self.thought: ReasoningItem | None = None
        self.call: FunctionCallItem | None = None  # named, its arguments still to come
        self.usage: Usage | None = None
        self.finish_reason: str | None = None

    def start(self) -> Iterator[bytes]:
        yield self.event("response.created", response=self.response)
        yield self.event("response.in_progress", response=self.response)

    def feed(self, chunk: ChatCompletionChunk) -> Iterator[bytes]:
        if chunk.usage is not None:
            self.usage = chunk.usage
        for choice in chunk.choices:
            delta, final = choice.delta, choice.finish_reason is not None
            reasoning = reasoning_of(delta)
            if reasoning:
                yield from self._add_text(ReasoningItem, reasoning)
            content, calls = delta.content, delta.tool_calls or []
            if self.thought is not None and (content or calls or final):
                cut = choice.finish_reason == "length" and not (content or calls)
                yield from self._close(self.thought, "incomplete" if cut else "completed")
                self.thought = None
            if content:
                yield from self._add_text(OutputMessage, content)
            for call in calls:
                yield from self._function_call(call)
            if final:
                self.finish_reason = choice.finish_reason
                if self.message is not None:
                    status = "incomplete" if choice.finish_reason == "length" else "completed"
                    yield from self._close(self.message, status)
                    self.message = None

    def close(self) -> Iterator[bytes]:
        usage = self.usage
        cached = usage.prompt_tokens_details.cached_tokens \
            if usage is not None and usage.prompt_tokens_details else 0
        finish_response(self.response, self.finish_reason, None if usage is None else
                        ResponseUsage.of(usage.prompt_tokens, usage.completion_tokens, cached))
        yield self.event(f"response.{self.response.status}", response=self.response)

    def _add_text(self, kind: type[TextItem], text: str) -> Iterator[bytes]:
        """Add `text` to the open item of `kind` (the answer's message or the reasoning),
        opening one, with its one text part, when there is none yet."""
        response = self.response
        item = self.thought if kind is ReasoningItem else self.message
        if item is None:
            prefix, empty = ("rs", ReasoningText(text="")) if kind is ReasoningItem \
                else ("msg", OutputText(text=""))
            item = kind(id=item_id(prefix), status="in_progress")
            yield self.event("response.output_item.added", output_index=len(response.output),
                             item=item)
            item.content.append(empty)
            response.output.append(item)
            yield self.event("response.content_part.added", item_id=item.id,
                             output_index=len(response.output) - 1, content_index=0, part=empty)
            if kind is ReasoningItem:
                self.thought = item
            else:
                self.message = item
        part = item.content[0]
        part.text += text
        extra = {"logprobs": []} if kind is OutputMessage else {}
        yield self.event(f"response.{part.type}.delta", item_id=item.id,
                         output_index=response.output.index(item), content_index=0, delta=text,
                         **extra)

    def _close(self, item: TextItem, status: str) -> Iterator[bytes]:
        index = self.response.output.index(item)
        part = item.content[0]
        item.status = status
        extra = {"logprobs": []} if isinstance(item, OutputMessage) else {}
        yield self.event(f"response.{part.type}.done", item_id=item.id, output_index=index,
                         content_index=0, text=part.text, **extra)
        yield self.event("response.content_part.done", item_id=item.id, output_index=index,
                         content_index=0, part=part)
        yield self.event("response.output_item.done", output_index=index, item=item)

    def _function_call(self, call) -> Iterator[bytes]:  # noqa: ANN001 - DeltaToolCall
        """A chat stream sends each call whole in two deltas: its id and name, its arguments."""
        if call.id is not None:
            if self.message is not None:
                yield from self._close(self.message, "completed")
                self.message = None
            self.call = FunctionCallItem(id=item_id("fc"), call_id=call.id,
                                         name=call.function.name, arguments="",
                                         status="in_progress")
            yield self.event("response.output_item.added", output_index=len(self.response.output),
                             item=self.call)
            self.response.output.append(self.call)
            return
        item, self.call = self.call, None
        if item is None:
            return
        index = self.response.output.index(item)
        arguments = call.function.arguments or ""
        yield self.event("response.function_call_arguments.delta", item_id=item.id,
                         output_index=index, delta=arguments)
        item.arguments, item.status = arguments, "completed"
        yield self.event("response.function_call_arguments.done", item_id=item.id,
                         output_index=index, name=item.name, arguments=arguments)
        yield self.event("response.output_item.done", output_index=index, item=item)
