"""Prompt rendering: the model's chat template over the whole conversation."""

from __future__ import annotations

from backend_engine.errors import InvalidRequestError
from protocol.tool_prompt import adapt_to_template


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
                continue_final_message: bool = False) -> list[int]:
    if not messages:
        raise InvalidRequestError("messages must not be empty", param="messages",
                                  code="invalid_value")
    if tokenizer.chat_template is None:
        raise InvalidRequestError("this model has no chat template; use /v1/completions",
                                  param="messages")
    messages, tools = adapt_to_template(tokenizer.chat_template, messages, tools)
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt and not
            continue_final_message, continue_final_message=continue_final_message,
            tokenize=False, **(chat_template_kwargs or {}))
    except InvalidRequestError:
        raise
    except Exception as exc:  # template errors are the caller's input problem
        raise InvalidRequestError(f"could not apply the chat template: {exc}",
                                  param="messages") from exc
    return tokenizer.encode(text, add_special_tokens=False)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    return tokenizer.encode(prompt, add_special_tokens=True)
