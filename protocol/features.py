"""Request features not every OpenAI-compatible server has, named once for both edges: a kvgate
replica lists the ones it serves in its model cards; the gateway sends a request only to
replicas that serve all the features it uses (foreign replicas: as configured per engine)."""

from __future__ import annotations

from typing import Any

JSON_OBJECT = "json_object"  # response_format json_object
JSON_SCHEMA = "json_schema"  # response_format json_schema
STRUCTURED_OUTPUTS = "structured_outputs"  # vLLM's extra: json, regex, choice, grammar
TOOLS = "tools"  # tool calling (tool_choice auto, required or a named function)
RESPONSES = "responses"  # the /v1/responses endpoint
MESSAGES = "messages"  # the /v1/messages endpoint (Anthropic's Messages API)

# kvgate's `return_token_ids` + `resume_token_ids`: a stream continued from token ids another
# replica generated (the gateway's mid-stream migration); never asked for by a client
RESUME = "resume"

ALL_FEATURES = frozenset({JSON_OBJECT, JSON_SCHEMA, STRUCTURED_OUTPUTS, TOOLS, RESPONSES,
                          MESSAGES, RESUME})
# What each kind of replica serves: kvgate replicas say so themselves; vLLM and SGLang serve all
# of these but token-id continuations; anything else is assumed to serve none of them.
ENGINE_FEATURES = {"kvgate": ALL_FEATURES, "vllm": ALL_FEATURES - {RESUME},
                   "sglang": ALL_FEATURES - {RESUME}, "other": frozenset()}
# The request field a missing feature is blamed on.
FEATURE_PARAMS = {JSON_OBJECT: "response_format", JSON_SCHEMA: "response_format",
                  STRUCTURED_OUTPUTS: "structured_outputs", TOOLS: "tools", RESPONSES: "input",
                  MESSAGES: "messages"}


def _format_features(fmt: Any) -> set[str]:
    kind = getattr(fmt, "type", None)
    return {JSON_OBJECT} if kind == "json_object" else {JSON_SCHEMA} if kind == "json_schema" \
        else set()


def required_features(req: Any, endpoint: str) -> frozenset[str]:
    """The features a parsed chat, completions or responses request uses (a Messages request:
    the chat request it becomes, `endpoint` "messages")."""
    needed: set[str] = {RESPONSES} if endpoint == "responses" else \
        {MESSAGES} if endpoint == "messages" else set()
    if endpoint == "responses":
        needed |= _format_features(req.text.format if req.text else None)
    else:
        needed |= _format_features(getattr(req, "response_format", None))
    if getattr(req, "structured_outputs", None) is not None:
        needed.add(STRUCTURED_OUTPUTS)
    tools = getattr(req, "tools", None)
    choice = req.tool_choice_name if hasattr(req, "tool_choice_name") else "none"
    if tools and choice != "none":
        needed.add(TOOLS)
    return frozenset(needed)
