"""Messages ⇄ chat completions: a Messages request becomes the chat completion request both edges
already render, tokenise and route (system → system message, tool_use → the assistant's
tool_calls, tool_result → tool messages, Anthropic tools and tool_choice → chat's), and a chat
completion becomes a Message. Assistant reasoning (`reasoning_content`, where chat messages carry
it) maps to `thinking` blocks both ways."""

from __future__ import annotations

import json
import re
from typing import Any

from protocol.anthropic import (ContentBlock, CountTokensRequest, Message, MessagesBase,
                                MessagesRequest, MessageUsage, StopReason, TextBlock,
                                ThinkingBlock, ToolUseBlock)
from protocol.chat import ChatCompletion, ChatCompletionRequest, ChatMessage
from protocol.errors import APIError, bad_request
from protocol.parsing import parse_request

# Set where chat messages carry the model's reasoning (the reasoning parser's field).
REASONING_FIELD = next((f for f in ("reasoning_content", "reasoning")
                        if f in ChatMessage.model_fields), None)
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Chat's names for the fields a Messages request calls otherwise, in error messages and params.
_CHAT_FIELD = re.compile(r"(tools\[\d+\])\.function\.parameters|(?<=')stop(?=')|^stop$")


def reasoning_of(message: Any) -> str | None:
    """The reasoning an assistant message or delta carries, whichever field name it uses."""
    for name in ("reasoning_content", "reasoning"):
        value = getattr(message, name, None)
        if value:
            return value
    return None


def to_chat(req: MessagesBase, stream_usage: bool = False) -> ChatCompletionRequest:
    """The same request as a chat completion (validated as one). `stream_usage`: a stream asks
    for usage on every chunk, which the event translation reads."""
    try:
        return parse_request(ChatCompletionRequest, chat_body(req, stream_usage))
    except APIError as err:  # chat's checks name chat's fields: name the client's
        err.message = _CHAT_FIELD.sub(_client_field, err.message)
        err.param = err.param and _CHAT_FIELD.sub(_client_field, err.param)
        err.args = (err.message,)
        raise


def chat_body(req: MessagesBase, stream_usage: bool = False) -> dict[str, Any]:
    """`to_chat`'s request as the JSON body of a chat completion (not yet validated)."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    last = req.messages[-1]
    if last.role == "assistant" and all(b.type == "text" for b in last.blocks()):
        body.update(add_generation_prompt=False, continue_final_message=True)  # a prefill
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description else {})}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None and req.tools:
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}} \
            if choice.type == "tool" else _CHOICES[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    if isinstance(req, MessagesRequest):
        body.update(_sampling(req, stream_usage))
    return body


def _client_field(match: re.Match) -> str:
    return f"{match[1]}.input_schema" if match[1] else "stop_sequences"


def _sampling(req: MessagesRequest, stream_usage: bool) -> dict[str, Any]:
    user_id = (req.metadata or {}).get("user_id")
    optional = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                "stop": req.stop_sequences or None, "user": user_id,
                "cache_salt": req.cache_salt, "request_id": req.request_id,
                "priority": req.priority}
    out = {k: v for k, v in optional.items() if v is not None}
    out.update(max_tokens=req.max_tokens, stream=bool(req.stream))
    if req.stream and stream_usage:
        out["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return out


def chat_messages(req: MessagesBase | CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages; 400 for a tool_result whose tool_use came before
    in no assistant message."""
    out: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else \
            "\n\n".join(b.text for b in req.system)
        out.append({"role": "system", "content": system})
    tool_use_ids: set[str] = set()
    for i, message in enumerate(req.messages):
        if message.role == "assistant":
            out.append(_assistant(message.blocks(), tool_use_ids, i))
        else:
            out.extend(_user(message.blocks(), tool_use_ids, i))
    return out


def _assistant(blocks: list[ContentBlock], tool_use_ids: set[str], i: int) -> dict[str, Any]:
    text = "".join(b.text or "" for b in blocks if b.type == "text")
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = []
    for j, block in enumerate(blocks):
        if block.type != "tool_use":
            continue
        if block.id in tool_use_ids:
            raise bad_request(f"Duplicate tool_use id '{block.id}'.",
                              f"messages[{i}].content[{j}].id", "invalid_value")
        tool_use_ids.add(block.id)
        calls.append({"id": block.id, "type": "function",
                      "function": {"name": block.name, "arguments": json.dumps(block.input)}})
    if calls:
        message["tool_calls"] = calls
    thinking = "".join(b.thinking or "" for b in blocks if b.type == "thinking")
    if thinking and REASONING_FIELD is not None:
        message[REASONING_FIELD] = thinking
    return message


def _user(blocks: list[ContentBlock], tool_use_ids: set[str], i: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for j, block in enumerate(blocks):
        if block.type == "text":
            text.append(block.text or "")
            continue
        if block.tool_use_id not in tool_use_ids:
            raise bad_request(
                f"'messages[{i}].content[{j}]': tool_result block(s) provided with no "
                f"corresponding tool_use block: '{block.tool_use_id}'.",
                f"messages[{i}].content[{j}].tool_use_id", "invalid_value")
        if text:
            out.append({"role": "user", "content": "".join(text)})
            text = []
        content = block.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content)
        out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content or ""})
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


# ---- the answer ------------------------------------------------------------------------------


def stop_reason(finish_reason: str | None, matched: str | int | None,
                stop_sequences: list[str] | None) -> tuple[StopReason | None, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat finish_reason and the vLLM-style
    `stop_reason` (the stop string or token id that matched)."""
    if finish_reason is None:
        return None, None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str) and matched in (stop_sequences or []):
        return "stop_sequence", matched
    return "end_turn", None


def message_of(chat: ChatCompletion, stop_sequences: list[str] | None) -> Message:
    choice = chat.choices[0]
    content: list[TextBlock | ThinkingBlock | ToolUseBlock] = []
    reasoning = reasoning_of(choice.message)
    if reasoning:
        content.append(ThinkingBlock(thinking=reasoning))
    if choice.message.content:
        content.append(TextBlock(text=choice.message.content))
    for call in choice.message.tool_calls:
        content.append(ToolUseBlock(id=call.id, name=call.function.name,
                                    input=json.loads(call.function.arguments)))  # a JSON object: the parser's rule
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, stop_sequences)
    usage = chat.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return Message(id=chat.id, model=chat.model, content=content, stop_reason=reason,
                   stop_sequence=sequence,
                   usage=MessageUsage.of(usage.prompt_tokens, usage.completion_tokens, cached))
