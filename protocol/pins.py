"""The pinned-prefix admin body, shared by the replica (`POST /admin/pins`) and the gateway
(`POST /admin/api/pins`): one model, and the prefix as exactly one of prompt text, token ids or
chat messages (rendered through the model's template without a generation prompt, so it is
the prefix of every conversation that starts with them)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from protocol.chat import ChatMessage
from protocol.common import StrictModel
from protocol.errors import bad_request

PIN_ID_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
MAX_PIN_TOKEN_IDS = 131072


class PinRequest(StrictModel):
    model: str = Field(min_length=1)
    id: str | None = Field(default=None, pattern=PIN_ID_PATTERN)
    prompt: str | None = None
    token_ids: list[int] | None = Field(default=None, max_length=MAX_PIN_TOKEN_IDS)
    messages: list[ChatMessage] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _one_prefix(self) -> "PinRequest":
        given = [name for name in ("prompt", "token_ids", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            raise bad_request("Give exactly one of 'prompt', 'token_ids' or 'messages'.", "prompt",
                              "invalid_value")
        name = given[0]
        if not getattr(self, name):
            raise bad_request(f"'{name}' must not be empty.", name, "invalid_value")
        if self.token_ids is not None and any(t < 0 for t in self.token_ids):
            raise bad_request("Token ids must be non-negative.", "token_ids", "invalid_value")
        for i, message in enumerate(self.messages or []):
            message.text(f"messages[{i}]")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict(i) for i, m in enumerate(self.messages or [])]

    def describe(self) -> str:
        """A short excerpt for listings: the first characters only (prompts may be private)."""
        if self.prompt is not None:
            text = self.prompt
        elif self.messages is not None:
            text = " | ".join(f"{m['role']}: {m['content']}" for m in self.template_messages())
        else:
            return f"[{len(self.token_ids or [])} token ids]"
        text = " ".join(text.split())
        return text if len(text) <= 40 else f"{text[:40]}… ({len(text)} chars)"
