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

    def prime(self, sent: str) -> None:
        """A resumed stream: feed the parsers the text another replica already streamed, and
        count the calls it sent, so what follows the seam parses as if nothing broke."""
        if self.reasoning is not None and sent:
            _, sent = self.reasoning.feed(sent, False)
        if self.tools is not None and sent:
            found = self.tools.feed(sent, final=False)
            self.num_calls += len(self.plan.keep(found.calls, self.num_calls))

    def finish_reason(self, reason: str) -> str:
        return tool_finish_reason(list(range(self.num_calls)), reason)


async def chat_stream(meta: ResponseMeta, started: list[Started], n: int, num_top: int | None,
                      include_usage: bool, continuous_usage: bool, plan: ToolPlan,
                      thinking: ReasoningPlan, token_ids: bool = False,
                      resumed: bool = False) -> AsyncIterator[bytes]:
    """`token_ids`: the last chunk of each engine output carries its new token ids (a chunk
    with an empty delta when its text is held back), so a reader that holds each output's chunks
    until then knows which tokens the text it passed on came from. `resumed`: the request
    continues another replica's stream (resume_token_ids)."""
    dump = {} if include_usage else {"exclude": {"usage"}}
    async for chunk in chat_chunks(meta, started, n, num_top, include_usage, continuous_usage,
                                   plan, thinking, token_ids, resumed):
        yield sse_data(chunk, **dump)
    yield DONE


async def chat_chunks(meta: ResponseMeta, started: list[Started], n: int, num_top: int | None,
                      include_usage: bool, continuous_usage: bool, plan: ToolPlan,
                      thinking: ReasoningPlan, token_ids: bool = False, resumed: bool = False
                      ) -> AsyncIterator[ChatCompletionChunk]:
    """The stream's chunks as objects (the Messages API translates them into its events)."""
    usage: Usage | None = None

    def chunk(choices: list[ChatChunkChoice], final_usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=meta.id, created=meta.created, model=meta.model,
            system_fingerprint=meta.system_fingerprint, choices=choices,
            usage=final_usage or (usage if continuous_usage else None))

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
            if resumed:
                resumed = False
                states[c.index].prime(c.text[:len(c.text) - len(c.delta_text)])
            choices = list(_choices(states[c.index], c, num_top))
            if token_ids and (choices or c.delta_token_ids):
                if not choices:
                    choices.append(ChatChunkChoice(index=c.index, delta=DeltaMessage(content="")))
                choices[-1].token_ids = list(c.delta_token_ids)
            for choice in choices:
                yield chunk([choice])
            if c.finish_reason is not None:
                finished.add(c.index)
    if include_usage and usage is not None:
        yield chunk([], usage)


def _choices(state: _Choice, c: CompletionOutput, num_top: int | None) -> Iterator[ChatChunkChoice]:
    """The chunks one engine output of one choice makes: deltas, then its finish."""
    logprobs = chat_logprobs(c.delta_logprobs, num_top) \
        if num_top is not None and c.delta_logprobs else None
    for delta in state.deltas(c):
        yield ChatChunkChoice(index=c.index, delta=delta, logprobs=logprobs)
        logprobs = None
    if logprobs is not None:  # tokens whose text is held back still report logprobs
        yield ChatChunkChoice(index=c.index, delta=DeltaMessage(content=""), logprobs=logprobs)
    if c.finish_reason is not None:
        yield ChatChunkChoice(index=c.index, delta=DeltaMessage(),
                              finish_reason=state.finish_reason(c.finish_reason),
                              stop_reason=c.stop_reason)


def usage_of(out) -> Usage:  # noqa: ANN001 - RequestOutput
    completion = sum(len(c.token_ids) for c in out.outputs)
    return Usage.of(len(out.prompt_token_ids), completion, out.num_cached_tokens)
