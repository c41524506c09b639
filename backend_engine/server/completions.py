"""`POST /v1/completions` (legacy): one or many prompts, as text or token ids, each with n samples;
choice index = prompt index × n + sample index, as OpenAI numbers them."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from starlette.requests import Request

from backend_engine.outputs import CompletionOutput, RequestOutput
from backend_engine.server.auth import require_api_key
from backend_engine.server.generation import Started, merged
from backend_engine.server.logprobs import legacy_logprobs, merge_legacy
from backend_engine.server.sampling import check_context_length, completion_sampling_params
from backend_engine.server.serving import ResponseMeta, aborted_error, serve_generation
from backend_engine.server.state import ServerState
from backend_engine.server.structured import disable_any_whitespace, structured_params
from protocol.common import Usage
from protocol.completions import Completion, CompletionChoice, CompletionRequest, LegacyLogprobs
from protocol.errors import bad_request
from protocol.parsing import parse_request
from protocol.sse import DONE, sse_data

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = parse_request(CompletionRequest, await request.body())
    engine = state.ready_engine()
    model = state.check_model(req.model)
    tokenizer = engine.tokenizer
    prompts: list[list[int]] = []
    for i, p in enumerate(req.prompts()):
        ids = tokenizer.encode(p, add_special_tokens=req.add_special_tokens is not False) if isinstance(p, str) else p
        if not ids:
            raise bad_request("The prompt is empty after tokenization.", "prompt", "invalid_value")
        check_context_length(len(ids), req.max_tokens, engine.max_model_len, "prompt")
        prompts.append(ids)
    if req.resume_token_ids and len(prompts) > 1:
        raise bad_request("'resume_token_ids' continues one prompt's sample.", "resume_token_ids", "invalid_value")
    params = completion_sampling_params(req)
    compact = disable_any_whitespace(state.settings.disable_any_whitespace, req.structured_outputs)
    params.structured_outputs = structured_params(req.response_format, req.structured_outputs, compact=compact)
    meta = ResponseMeta.new("cmpl", model, req.request_id or request.headers.get("x-request-id"))
    echo = [tokenizer.decode(ids) if req.echo else "" for ids in prompts]
    first_tokens = [tokenizer.decode(ids[:1]) for ids in prompts]
    view = _View(meta, params.n, req.logprobs, echo, first_tokens, bool(req.return_token_ids))

    def render_stream(started: list[Started]) -> AsyncIterator[bytes]:
        return completion_stream(view, started, req.include_usage)

    return await serve_generation(
        request, state, meta, prompts, params, req.cache_salt, bool(req.stream), render_stream, view.final,
        priority=req.priority or 0, kv_transfer=req.kv_transfer_params,
    )


class _View:
    """How one request's outputs become legacy completion choices."""

    def __init__(self, meta: ResponseMeta, n: int, num_logprobs: int | None, echo: list[str], first_tokens: list[str],
                 token_ids: bool = False):
        self.meta, self.n, self.num_logprobs = meta, n, num_logprobs
        self.echo, self.first_tokens = echo, first_tokens
        self.token_ids = token_ids  # return_token_ids: see chat_stream for the stream's contract

    def index(self, prompt_index: int, c: CompletionOutput) -> int:
        return prompt_index * self.n + c.index

    def echo_logprobs(self, prompt_index: int, out: RequestOutput) -> LegacyLogprobs | None:
        if not self.echo[prompt_index] or self.num_logprobs is None or out.prompt_logprobs is None:
            return None
        return legacy_logprobs(out.prompt_logprobs, self.num_logprobs, 0, self.first_tokens[prompt_index])

    def logprobs(self, prompt_index: int, out: RequestOutput, c: CompletionOutput) -> LegacyLogprobs | None:
        if self.num_logprobs is None:
            return None
        generated = legacy_logprobs(c.logprobs or [], self.num_logprobs, len(self.echo[prompt_index]))
        return merge_legacy(self.echo_logprobs(prompt_index, out), generated)

    def final(self, outputs: list[RequestOutput]) -> Completion:
        choices = [
            CompletionChoice(
                index=self.index(i, c), text=self.echo[i] + c.text, logprobs=self.logprobs(i, out, c),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if self.token_ids else None,
            )
            for i, out in enumerate(outputs)
            for c in sorted(out.outputs, key=lambda c: c.index)
        ]
        return self.completion(choices, usage_of(outputs))

    def completion(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        m = self.meta
        return Completion(id=m.id, created=m.created, model=m.model, system_fingerprint=m.system_fingerprint,
                          choices=choices, usage=usage)


def usage_of(outputs: list[RequestOutput]) -> Usage:
    return Usage.of(
        sum(len(o.prompt_token_ids) for o in outputs),
        sum(len(c.token_ids) for o in outputs for c in o.outputs),
        sum(o.num_cached_tokens for o in outputs),
    )


async def completion_stream(view: _View, started: list[Started], include_usage: bool) -> AsyncIterator[bytes]:
    dump = {} if include_usage else {"exclude": {"usage"}}

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        return sse_data(view.completion(choices, usage), **dump)

    offsets: dict[int, int] = {}  # choice index → characters sent so far (legacy text_offset)
    last: dict[int, RequestOutput] = {}
    finished: set[int] = set()
    echo_sent: set[int] = set()
    async for i, out in merged(started):
        last[i] = out
        for c in out.outputs:
            index = view.index(i, c)
            if index in finished:
                continue
            if index not in echo_sent and view.echo[i]:
                echo_sent.add(index)
                offsets[index] = len(view.echo[i])
                yield chunk([CompletionChoice(index=index, text=view.echo[i], logprobs=view.echo_logprobs(i, out))])
            if c.finish_reason == "abort":
                raise aborted_error()
            choices = []
            if c.delta_text or (view.num_logprobs is not None and c.delta_logprobs):
                logprobs = None
                if view.num_logprobs is not None:
                    logprobs = legacy_logprobs(c.delta_logprobs or [], view.num_logprobs, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(c.delta_text)
                choices.append(CompletionChoice(index=index, text=c.delta_text, logprobs=logprobs))
            if c.finish_reason is not None:
                finished.add(index)
                choices.append(CompletionChoice(index=index, text="", finish_reason=c.finish_reason,
                                                stop_reason=c.stop_reason))
            if view.token_ids and (choices or c.delta_token_ids):
                if not choices:
                    choices.append(CompletionChoice(index=index, text=""))
                choices[-1].token_ids = list(c.delta_token_ids)
            for choice in choices:
                yield chunk([choice])
    if include_usage:
        yield chunk([], usage_of([last[i] for i in sorted(last)]))
    yield DONE
