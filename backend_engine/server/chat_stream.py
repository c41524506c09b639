"""`chat.completion.chunk` events: a role delta per choice, content deltas, tool calls (index, id,
type and name first, then the arguments) once each is complete, a finish chunk per choice, an
optional usage chunk, then `[DONE]`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from backend_engine.outputs import CompletionOutput
from backend_engine.reasoning import ReasoningStream
from backend_engine.server.generation import Started, merged
from backend_engine.server.logprobs import chat_logprobs
from backend_engine.server.reasoning_plan import ReasoningPlan
from backend_engine.server.serving import ResponseMeta, aborted_error
from backend_engine.server.tool_plan import ToolPlan, new_call_id, tool_finish_reason
from backend_engine.tool_parsers.stream import StreamDelta, ToolCallStream
from protocol.chat import ChatChunkChoice, ChatCompletionChunk, DeltaMessage
from protocol.common import Usage
from protocol.sse import DONE, sse_data
from protocol.tools import DeltaFunctionCall, DeltaToolCall


class _Choice:
    """One choice's stream state: its reasoning and tool-call parsers and the calls sent so far."""

    def __init__(self, plan: ToolPlan, thinking: ReasoningPlan):
        self.plan = plan
        self.reasoning: ReasoningStream | None = thinking.stream()
        self.include_reasoning = thinking.include
        self.tools: ToolCallStream | None = plan.stream()
        self.num_calls = 0

    def deltas(self, c: CompletionOutput) -> Iterator[DeltaMessage]:
        final = c.finish_reason is not None
        text = c.delta_text
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text, final)
            if reasoning and self.include_reasoning:
                yield DeltaMessage(reasoning_content=reasoning, reasoning=reasoning)
        if self.tools is None:
            if text:
                yield DeltaMessage(content=text)
            return
        found: StreamDelta = self.tools.feed(text, final=final)
        if found.content:
            yield DeltaMessage(content=found.content)
        for call in self.plan.keep(found.calls, self.num_calls):
            index = self.num_calls
            self.num_calls += 1
            yield DeltaMessage(tool_calls=[DeltaToolCall(
                index=index, id=new_call_id(), type="function",
                function=DeltaFunctionCall(name=call.name, arguments=""))])
            yield DeltaMessage(tool_calls=[DeltaToolCall(
                index=index, function=DeltaFunctionCall(arguments=call.arguments))])

    def finish_reason(self, reason: str) -> str:
        return tool_finish_reason(list(range(self.num_calls)), reason)


async def chat_stream(meta: ResponseMeta, started: list[Started], n: int, num_top: int | None,
                      include_usage: bool, continuous_usage: bool, plan: ToolPlan,
                      thinking: ReasoningPlan) -> AsyncIterator[bytes]:
    dump = {} if include_usage else {"exclude": {"usage"}}
    usage: Usage | None = None

    def chunk(choices: list[ChatChunkChoice], final_usage: Usage | None = None) -> bytes:
        c = ChatCompletionChunk(
            id=meta.id, created=meta.created, model=meta.model,
            system_fingerprint=meta.system_fingerprint, choices=choices,
            usage=final_usage or (usage if continuous_usage else None))
        return sse_data(c, **dump)

    for index in range(n):
        yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
    states = {index: _Choice(plan, thinking) for index in range(n)}
    finished: set[int] = set()
    async for _, out in merged(started):
        usage = usage_of(out)
        for c in out.outputs:
            if c.index in finished:
                continue
            if c.finish_reason == "abort":
                raise aborted_error()
            logprobs = chat_logprobs(c.delta_logprobs, num_top) \
                if num_top is not None and c.delta_logprobs else None
            for delta in states[c.index].deltas(c):
                yield chunk([ChatChunkChoice(index=c.index, delta=delta, logprobs=logprobs)])
                logprobs = None
            if logprobs is not None:  # tokens whose text is held back still report logprobs
                yield chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(content=""),
                                             logprobs=logprobs)])
            if c.finish_reason is not None:
                finished.add(c.index)
                yield chunk([ChatChunkChoice(
                    index=c.index, delta=DeltaMessage(),
                    finish_reason=states[c.index].finish_reason(c.finish_reason),
                    stop_reason=c.stop_reason)])
    if include_usage and usage is not None:
        yield chunk([], usage)
    yield DONE


def usage_of(out) -> Usage:  # noqa: ANN001 - RequestOutput
    completion = sum(len(c.token_ids) for c in out.outputs)
    return Usage.of(len(out.prompt_token_ids), completion, out.num_cached_tokens)
