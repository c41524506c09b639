"""Tokenise exactly as a replica does, without transformers (which would pull in torch): the
model's `tokenizer.json` (from its folder, or as a kvgate replica serves it) through the
`tokenizers` library and its chat template through a sandboxed Jinja2 environment configured as
transformers configures it. Start-up parity checks against each replica's `/tokenize` prove the
two agree."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gateway.segment_cache import SegmentCache
from protocol.tokenizer_bundle import SPECIAL_TOKENS, TokenizerBundle
from protocol.tool_prompt import adapt_to_template


TOKEN_TEXTS_CACHED = 8192


class TokenizerUnavailable(RuntimeError):
    """No local tokenizer for a model: the gateway asks a replica's /tokenize instead."""


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (the caller's input problem, answered with 400)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # transformers overrides Jinja's tojson so non-ASCII text survives as is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class LocalTokenizer:
    """One model's tokenizer and chat template: from its folder, or from a replica's bundle."""

    def __init__(self, tokenizer: Tokenizer, template: Any, special: dict[str, str | None],
                 source: str) -> None:
        self.tokenizer = tokenizer
        self.special = special
        self.source = source  # where it came from, for the logs: a folder or a bundle's hash
        self.template = None
        self.template_source = template if isinstance(template, str) else None
        if isinstance(template, str):
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self.template = env.from_string(template)
        self._token_texts: dict[int, str] = {}
        self.segments = SegmentCache(tokenizer, source)  # a chat's repeated pieces, tokenised once

    @classmethod
    def from_folder(cls, folder: str | Path) -> "LocalTokenizer":
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise TokenizerUnavailable(f"{folder} has no tokenizer.json")
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS}
        return cls(Tokenizer.from_file(str(folder / "tokenizer.json")), template, special,
                   str(folder))

    @classmethod
    def from_bundle(cls, bundle: TokenizerBundle, digest: str) -> "LocalTokenizer":
        """A replica's bundle (protocol/tokenizer_bundle.py); raises ValueError if unusable."""
        try:
            tokenizer = Tokenizer.from_str(bundle.tokenizer_json)
            return cls(tokenizer, bundle.chat_template, dict(bundle.special_tokens), digest)
        except TemplateError as exc:
            raise ValueError(f"the bundle's chat template does not compile: {exc}") from None
        except Exception as exc:  # tokenizers raises its own Exception type on bad JSON
            raise ValueError(f"the bundle's tokenizer does not load: {exc}") from None

    def encode_prompt(self, prompt: str) -> list[int]:
        """A completions prompt: special tokens added, as the engine's encode_prompt."""
        return self.tokenizer.encode(prompt, add_special_tokens=True).ids

    def decode(self, token_ids: list[int]) -> str:
        """Text of token ids, special tokens included."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """One token's text, cached (prefix advice reads the same few tokens again and again)."""
        text = self._token_texts.get(token_id)
        if text is None:
            if len(self._token_texts) >= TOKEN_TEXTS_CACHED:
                self._token_texts.clear()
            text = self._token_texts[token_id] = self.decode([token_id])
        return text

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
                    continue_final_message: bool = False) -> list[int]:
        if self.template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        messages, tools = adapt_to_template(self.template_source, messages, tools)
        try:
            text = self.template.render(
                messages=messages, tools=tools,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                **{k: v for k, v in self.special.items() if v is not None},
                **(chat_template_kwargs or {}))
        except TemplateError as exc:
            raise ChatTemplateError(f"could not apply the chat template: {exc}") from exc
        if continue_final_message:
            text = _strip_after_final(text, messages)
        return self.segments.encode(text)


def _strip_after_final(text: str, messages: list[dict]) -> str:
    """Cut the end-of-turn tokens after the final message, as transformers does."""
    final = messages[-1].get("content") or ""
    if isinstance(final, str) and final.strip() and final.strip() in text:
        return text[: text.rindex(final.strip()) + len(final.strip())]
    return text
