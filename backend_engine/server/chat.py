"""`POST /v1/chat/completions`: render the conversation with the model's chat template, generate
(constrained when the request asks for JSON or forces tool calls), and answer as one
`chat.completion` or as `chat.completion.chunk` events (backend_engine/server/chat_stream.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from starlette.requests import Request

from backend_engine.errors import InvalidRequestError
from backend_engine.outputs import RequestOutput
from backend_engine.sampling_params import SamplingParams
from backend_engine.server.auth import require_api_key
from backend_engine.server.chat_stream import chat_stream, usage_of
from backend_engine.server.generation import Started
from backend_engine.server.logprobs import chat_logprobs
from backend_engine.server.reasoning_plan import ReasoningPlan
from backend_engine.server.sampling import chat_sampling_params, check_context_length, engine_error_to_api
from backend_engine.server.serving import ResponseMeta, serve_generation
from backend_engine.server.state import ServerState
from backend_engine.server.structured import (CHAT_SCHEMA_PARAM, disable_any_whitespace, response_schema,
                                              structured_params)
from backend_engine.server.tool_plan import ToolPlan
from protocol.chat import AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionRequest
from protocol.parsing import parse_request

router = APIRouter(dependencies=[Depends(require_api_key)])


def plan_tools(state: ServerState, req: ChatCompletionRequest,
               schema_param: str = CHAT_SCHEMA_PARAM) -> ToolPlan:
    schema = response_schema(req.response_format)
    extra = req.structured_outputs
    compact = disable_any_whitespace(state.settings.disable_any_whitespace, extra)
    return ToolPlan.build(req.tool_functions, req.tool_choice_name,
                          req.parallel_tool_calls, state.tool_parser,
                          None if extra is not None and extra.has_constraint else schema,
                          structured_params(req.response_format, extra, schema_param, compact),
                          compact)


def with_plan(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    changes: dict = {"structured_outputs": plan.structured}
    if plan.skip_special_tokens_off:
        changes["skip_special_tokens"] = False
    return dataclasses.replace(params, **changes)


def render_prompt(engine, req: ChatCompletionRequest, param: str = "messages") -> list[int]:  # noqa: ANN001
    """The conversation (tools included) through the model's chat template, as token ids that
    leave room for the requested completion."""
    prompt = render_tokens(engine, req)
    check_context_length(len(prompt), req.max_output_tokens, engine.max_model_len, param)
    return prompt


def render_tokens(engine, req: ChatCompletionRequest) -> list[int]:  # noqa: ANN001
    """The conversation (tools included) through the model's chat template, as token ids."""
    try:
        return engine.render_chat(
            req.template_messages(),
            add_generation_prompt=req.add_generation_prompt is not False,
            chat_template_kwargs=req.chat_template_kwargs,
            tools=req.template_tools(),
            continue_final_message=bool(req.continue_final_message),
        )
    except InvalidRequestError as exc:
        raise engine_error_to_api(exc) from None


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = parse_request(ChatCompletionRequest, await request.body())
    engine = state.ready_engine()
    model = state.check_model(req.model)
    plan = plan_tools(state, req)
    prompt = render_prompt(engine, req)
    thinking = ReasoningPlan.build(state.reasoning_parser, engine.tokenizer, prompt, req.include_reasoning)
    params = thinking.constrain(with_plan(chat_sampling_params(req), plan))
    meta = ResponseMeta.new("chatcmpl", model, req.request_id or request.headers.get("x-request-id"))
    continuous = bool(req.include_usage and req.stream_options and req.stream_options.continuous_usage_stats)

    def render_stream(started: list[Started]) -> AsyncIterator[bytes]:
        return chat_stream(meta, started, params.n, req.num_logprobs, req.include_usage, continuous, plan,
                           thinking, bool(req.return_token_ids), bool(req.resume_token_ids))

    def render_final(outputs: list[RequestOutput]) -> ChatCompletion:
        return chat_completion(meta, outputs[0], req.num_logprobs, plan, thinking,
                               bool(req.return_token_ids))

    return await serve_generation(
        request, state, meta, [prompt], params, req.cache_salt, bool(req.stream), render_stream, render_final,
        priority=req.priority or 0, kv_transfer=req.kv_transfer_params,
    )


def chat_completion(meta: ResponseMeta, out: RequestOutput, num_top: int | None,
                    plan: ToolPlan, thinking: ReasoningPlan,
                    token_ids: bool = False) -> ChatCompletion:
    choices = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        reasoning, text = thinking.split(c.text)
        content, calls, finish_reason = plan.answer(text or "", c.finish_reason)
        if text is None:
            content = None  # no answer after the reasoning (cut off while thinking)
        choices.append(ChatChoice(
            index=c.index,
            message=AssistantMessage(content=content, tool_calls=calls,
                                     reasoning_content=reasoning, reasoning=reasoning),
            logprobs=chat_logprobs(c.logprobs, num_top) if num_top is not None else None,
            finish_reason=finish_reason,
            stop_reason=c.stop_reason,
            token_ids=list(c.token_ids) if token_ids else None,
        ))
    return ChatCompletion(
        id=meta.id, created=meta.created, model=meta.model, system_fingerprint=meta.system_fingerprint,
        choices=choices, usage=usage_of(out),
    )
