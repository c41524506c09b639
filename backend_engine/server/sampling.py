"""OpenAI request fields → the engine's SamplingParams, and engine exceptions → OpenAI errors."""

from __future__ import annotations

from backend_engine.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
)
from backend_engine.sampling_params import SamplingParams
from protocol.chat import ChatCompletionRequest
from protocol.common import SamplingFields
from protocol.completions import CompletionRequest
from protocol.errors import (
    APIError,
    bad_request,
    context_length_exceeded,
    internal_error,
    service_unavailable,
    unsupported,
)

ENGINE_HAS_PROMPT_LOGPROBS = "prompt_logprobs" in SamplingParams.__dataclass_fields__


def _common(req: SamplingFields) -> dict:
    kwargs: dict = {
        "n": req.n or 1,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "logit_bias": req.logit_bias_ids,
        "seed": req.seed,
        "stop": req.stop_list,
        "stop_token_ids": list(req.stop_token_ids or []),
        "include_stop_str_in_output": bool(req.include_stop_str_in_output),
        "ignore_eos": bool(req.ignore_eos),
        "skip_special_tokens": req.skip_special_tokens is not False,
        "resume_token_ids": list(req.resume_token_ids or []),
    }
    if req.top_k is not None:
        kwargs["top_k"] = req.top_k
    if req.min_p is not None:
        kwargs["min_p"] = req.min_p
    if req.repetition_penalty is not None:
        kwargs["repetition_penalty"] = req.repetition_penalty
    if req.min_tokens is not None:
        kwargs["min_tokens"] = req.min_tokens
    return kwargs


def chat_sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    return _build(**_common(req), max_tokens=req.max_output_tokens, logprobs=req.num_logprobs)


def completion_sampling_params(req: CompletionRequest) -> SamplingParams:
    kwargs = _common(req)
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_logprobs = req.logprobs
    if prompt_logprobs is not None:
        if not ENGINE_HAS_PROMPT_LOGPROBS:
            param = "prompt_logprobs" if req.prompt_logprobs is not None else "echo"
            raise unsupported(param, "Prompt logprobs (echo with logprobs)")
        kwargs["prompt_logprobs"] = prompt_logprobs
    return _build(**kwargs, max_tokens=req.max_tokens, logprobs=req.logprobs)


def _build(**kwargs) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError as exc:
        raise engine_error_to_api(exc) from None


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str) -> None:
    """OpenAI's rule: prompt plus requested completion must fit the context window."""
    if num_prompt_tokens >= max_model_len or (max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len):
        requested = num_prompt_tokens + (max_tokens or 0)
        raise context_length_exceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{requested} tokens ({num_prompt_tokens} in the {param}, {max_tokens or 0} in the completion). "
            "Please reduce the length of the prompt or the completion.",
            param,
        )


def engine_error_to_api(exc: Exception, retry_after_s: int = 1) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthExceededError):
        return context_length_exceeded(exc.message, exc.param)
    if isinstance(exc, InvalidRequestError):
        return bad_request(exc.message, exc.param, exc.code)
    if isinstance(exc, EngineOverloadedError):
        return service_unavailable(f"This replica is overloaded; retry shortly ({exc}).",
                                   exc.retry_after_s or retry_after_s, "engine_overloaded")
    if isinstance(exc, EngineDeadError):
        return service_unavailable("The engine stopped after an internal error.", None, "engine_dead")
    return internal_error()
