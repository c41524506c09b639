"""Admission of one OpenAI (or Anthropic Messages) request, the same for every entry point (the
HTTP proxy and the Envoy endpoint picker): parse and validate the body, check features and
limits, apply the key's tenant and priority, tokenise as the engine will, rate-limit, and hash
the prompt's blocks."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Mapping

from gateway.config import ApiKey
from gateway.chat_rendered import resumable_rendered
from gateway.forward import RoutedRequest
from gateway.resumable import resumable
from gateway.priority import effective_priority
from gateway.state import GatewayState
from gateway.upstream import forwarded_headers
from protocol.anthropic import CountTokensRequest, CountTokensResponse, MessagesRequest
from protocol.anthropic_chat import to_chat
from protocol.chat import ChatCompletionRequest
from protocol.completions import CompletionRequest
from protocol.errors import APIError, bad_request, context_length_exceeded, model_not_found
from protocol.features import FEATURE_PARAMS, required_features
from protocol.parsing import parse_json_body, parse_request
from protocol.responses import ResponsesRequest
from routing.hashing import block_hashes, namespace_for
from routing.rate_limit import RateLimit

log = logging.getLogger(__name__)

COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
# path -> (endpoint name, request model)
ENDPOINTS = {"/v1/chat/completions": ("chat", ChatCompletionRequest),
             "/v1/completions": ("completions", CompletionRequest),
             "/v1/responses": ("responses", ResponsesRequest),
             "/v1/messages": ("messages", MessagesRequest)}


def tenant_salt(key: ApiKey | None, cache_salt: str | None) -> str | None:
    """The cache salt the replica must use: the key's tenant first when it is isolated, so no
    request of another key can produce (or probe) a hit on its blocks. A client's own salt that
    looks like a tenant's (or like an escaped one) is escaped, so the mapping stays one-to-one."""
    if key is not None and key.isolate_cache:
        return f"tenant:{key.name}" + (f"|{cache_salt}" if cache_salt else "")
    if cache_salt is not None and cache_salt.startswith(("tenant:", "salt:")):
        return f"salt:{cache_salt}"
    return cache_salt


def _check_features(serving: list, req, endpoint: str) -> frozenset[str]:  # noqa: ANN001
    """The features the request uses; 400 naming the field when no replica of the model has them."""
    needed = required_features(req, endpoint)
    if needed and not any(r.supports(needed) for r in serving):
        served = frozenset().union(*(r.features for r in serving))
        missing = sorted(needed - served) or sorted(needed)  # else no one replica has them all
        param = FEATURE_PARAMS[missing[0]]
        raise bad_request(f"No replica of model '{req.model}' supports {', '.join(missing)} (a "
                          "foreign replica's engine is given with --replica-engine URL=vllm).",
                          param, "unsupported_parameter")
    return needed


def _check_limits(state: GatewayState, req: ChatCompletionRequest | CompletionRequest |
                  ResponsesRequest | MessagesRequest) -> None:
    if getattr(req, "kv_transfer_params", None) is not None:  # the Responses API has no field
        raise bad_request("'kv_transfer_params' is set by the gateway for prefill/decode pairs; "
                          "clients may not send it.", "kv_transfer_params", "invalid_value")
    if isinstance(req, (ChatCompletionRequest, MessagesRequest)) \
            and len(req.messages) > state.config.max_messages:
        raise bad_request(f"'messages' holds at most {state.config.max_messages} messages.",
                          "messages", "invalid_value")
    if isinstance(req, CompletionRequest) and len(req.prompts()) > 256:
        raise bad_request("'prompt' holds at most 256 prompts.", "prompt", "invalid_value")


async def _check_rate(state: GatewayState, key: ApiKey | None, tokens: int) -> None:
    if key is None or (key.requests_per_minute is None and key.tokens_per_minute is None):
        return
    limit = RateLimit(key.requests_per_minute, key.tokens_per_minute)
    decision = await state.limiter.check(key.name, tokens, limit)
    if decision.allowed:
        return
    state.metrics.rate_limited.labels(key.name).inc()
    over_requests = (limit.requests_per_minute is not None
                     and decision.requests > limit.requests_per_minute)
    what, used, cap = (("requests per min (RPM)", decision.requests, limit.requests_per_minute)
                       if over_requests else
                       ("tokens per min (TPM)", decision.tokens, limit.tokens_per_minute))
    retry = max(1, int(decision.retry_after_s + 0.999))
    raise APIError(429, f"Rate limit reached for key '{key.name}' on {what}: Limit {cap}, "
                        f"Used {used}. Please try again in {retry}s.",
                   "requests" if over_requests else "tokens", None, "rate_limit_exceeded",
                   {"Retry-After": str(retry)})


def _advise(state: GatewayState, key: ApiKey | None, model: str, tokens: list[int],
            salt: str | None) -> None:
    """Feed the prompt to the prefix-stability advisor (it reads fields with the model's local
    tokenizer, so models tokenised remotely get no advice)."""
    tokenizer = state.tokens.local(model)
    if state.advice is None or tokenizer is None:
        return
    try:
        found = state.advice.observe(key.name if key else "anonymous", model, tokens,
                                     tokenizer, salt)
    except Exception:  # noqa: BLE001 - advice must never fail the request it watches
        log.exception("prefix advice failed on a prompt of %d tokens", len(tokens))
        return
    if found is not None:
        state.metrics.prefix_advice.record(found)


SESSION_HEADER = "x-session-id"


def routing_hint(req: ChatCompletionRequest | CompletionRequest | ResponsesRequest,
                 headers: Mapping[str, str], namespace: str) -> str | None:
    """The client's statement of which requests share a prefix: the session header, else
    OpenAI's `prompt_cache_key`, else `user` (Anthropic's `metadata.user_id`). Scoped by the prompt's namespace (model and
    tenant salt), so equal keys of two tenants or models need not share a home."""
    hint = (headers.get(SESSION_HEADER) or getattr(req, "prompt_cache_key", None)
            or req.user)
    return f"{namespace}\x00{hint}" if hint else None


def _tokenizer_candidates(state: GatewayState, serving: list) -> list[tuple[str, int]]:
    """The replicas that may tokenise a request remotely, with their requests in flight: the
    routable ones (any of the model's, when none is)."""
    ready = [r for r in serving if r.routable()] or serving
    return [(r.url, state.router.load.view(r.name).in_flight if r.name in state.router.replicas
             else 0) for r in ready]


async def admit(state: GatewayState, key: ApiKey | None, raw: bytes, path: str,
                headers: Mapping[str, str], started: float | None = None) -> RoutedRequest:
    """The request as routing sees it; raises APIError (400, 404, 429, 503) before any replica
    is asked to generate. `headers`: the client's, lower-case names."""
    started = time.perf_counter() if started is None else started
    endpoint, model_cls = ENDPOINTS[path]
    data = parse_json_body(raw)
    req = parse_request(model_cls, data)
    _check_limits(state, req)
    serving = state.serving(req.model)
    if not serving:
        raise model_not_found(req.model)
    chat = req.to_chat() if isinstance(req, ResponsesRequest) else \
        to_chat(req) if isinstance(req, MessagesRequest) else req
    features = _check_features(serving, chat if endpoint == "messages" else req, endpoint)
    salt = tenant_salt(key, req.cache_salt)
    priority = effective_priority(key, req.priority)
    changes: dict = {}  # forwarded byte for byte unless the namespace or priority must change
    if salt != req.cache_salt:
        changes["cache_salt"] = salt
    if priority != (req.priority or 0):
        changes["priority"] = priority  # the key's default
    body = json.dumps({**data, **changes}, separators=(",", ":")).encode() if changes else raw
    tokenizers = _tokenizer_candidates(state, serving)
    if isinstance(chat, ChatCompletionRequest):
        tokens = await state.tokens.chat(chat, tokenizers)
        max_out = chat.max_output_tokens or 0
    else:
        tokens = await state.tokens.prompt(req.model, req.prompts()[0], tokenizers)
        max_out = req.max_tokens or 0
    if len(tokens) > state.config.max_prompt_tokens:
        raise context_length_exceeded(
            f"The prompt has {len(tokens)} tokens; this gateway accepts at most "
            f"{state.config.max_prompt_tokens}.",
            {"chat": "messages", "responses": "input", "messages": "messages"}.get(endpoint, "prompt"))
    await _check_rate(state, key, len(tokens) + max_out * (getattr(req, "n", None) or 1))
    _advise(state, key, req.model, tokens, salt)
    namespace = namespace_for(serving[0].namespace_model or req.model, salt)
    hashes = block_hashes(tokens, namespace, state.router.block_size)
    request_id = req.request_id or headers.get("x-request-id") or uuid.uuid4().hex
    single_prompt = not isinstance(req, CompletionRequest) or len(req.prompts()) == 1
    migrates = None
    if state.config.migration_limit > 0 and isinstance(req, (ChatCompletionRequest, CompletionRequest)):
        migrates = resumable({**data, **changes}, req.n or 1, single_prompt, bool(req.stream),
                             req.include_usage)
    elif state.config.migration_limit > 0:  # a Messages or Responses request
        migrates = resumable_rendered(req, path, changes)
    return RoutedRequest(request_id, endpoint, path, body, forwarded_headers(headers),
                         req.model, bool(req.stream), hashes, len(tokens), started, priority,
                         single_prompt=single_prompt, features=features,
                         prompt_token_ids=tokens if migrates is not None else [],
                         namespace=namespace, resumable=migrates,
                         session_key=routing_hint(chat if endpoint == "messages" else req,
                                                  headers, namespace))


async def count_tokens(state: GatewayState, raw: bytes) -> CountTokensResponse:
    """`/v1/messages/count_tokens`, counted with the tokenisation routing uses: the gateway's
    own tokenizer of the model, else a replica's /tokenize."""
    req = parse_request(CountTokensRequest, raw)
    serving = state.serving(req.model)
    if not serving:
        raise model_not_found(req.model)
    tokens = await state.tokens.chat(to_chat(req), _tokenizer_candidates(state, serving))
    return CountTokensResponse(input_tokens=len(tokens))
