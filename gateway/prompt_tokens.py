"""The prompt's token ids, as the replica will see them: from the local tokenizer of the model
when the gateway has its files, otherwise from a replica's `/tokenize` (one extra round trip).
Also the start-up parity check of the local tokenizer against each replica."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx

from gateway.tokenizer import ChatTemplateError, LocalTokenizer, TokenizerUnavailable
from protocol.chat import ChatCompletionRequest
from protocol.errors import APIError, bad_request

log = logging.getLogger(__name__)

# Conversations that exercise the template: system turn, several turns, unicode, whitespace.
PARITY_CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "2 + 2 ="},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": "  and héllo wörld 🙂\n\ttabs?"}],
]
PARITY_PROMPTS = ["The quick brown fox", "  leading spaces, ünïcode 🙂\nnew line"]


class PromptTokens:
    def __init__(self, folders: dict[str, str], client: httpx.AsyncClient) -> None:
        self.folders = folders
        self.client = client
        self._local: dict[str, LocalTokenizer | None] = {}

    def local(self, model: str) -> LocalTokenizer | None:
        if model not in self._local:
            folder = self.folders.get(model) or self.folders.get("*")
            if folder is None and Path(model).is_dir():
                folder = model
            tokenizer = None
            if folder is not None:
                try:
                    tokenizer = LocalTokenizer(folder)
                except (TokenizerUnavailable, OSError, ValueError) as exc:
                    log.warning("no local tokenizer for %s (%s): using replicas' /tokenize", model, exc)
            self._local[model] = tokenizer
        return self._local[model]

    async def chat(self, req: ChatCompletionRequest, replica_url: str | None) -> list[int]:
        tokenizer = self.local(req.model)
        messages = req.template_messages()
        if tokenizer is not None:
            try:
                return tokenizer.render_chat(
                    messages, req.add_generation_prompt is not False, req.chat_template_kwargs,
                    req.template_tools(), bool(req.continue_final_message))
            except ChatTemplateError as exc:
                raise bad_request(str(exc), "messages") from None
        body = {"model": req.model, "messages": messages,
                "add_generation_prompt": req.add_generation_prompt is not False,
                "continue_final_message": bool(req.continue_final_message)}
        if req.chat_template_kwargs:
            body["chat_template_kwargs"] = req.chat_template_kwargs
        if req.tools:
            body["tools"] = req.template_tools()
        return await self._remote(replica_url, body)

    async def prompt(self, model: str, prompt: str | list[int], replica_url: str | None) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        tokenizer = self.local(model)
        if tokenizer is not None:
            return tokenizer.encode_prompt(prompt)
        return await self._remote(replica_url, {"model": model, "prompt": prompt})

    async def _remote(self, replica_url: str | None, body: dict) -> list[int]:
        if replica_url is None:
            raise APIError(503, "No replica can tokenize this request.", "server_error", None,
                           "service_unavailable", {"Retry-After": "1"})
        response = await self.client.post(f"{replica_url}/tokenize", json=body, timeout=10.0)
        if response.status_code == 400:
            error = response.json().get("error", {})
            raise bad_request(error.get("message", "invalid request"), error.get("param"))
        response.raise_for_status()
        return list(response.json()["tokens"])

    async def check_parity(self, model: str, replica_url: str) -> str:
        """'ok', 'mismatch: …', 'remote' (no local tokenizer) or 'unavailable'."""
        tokenizer = self.local(model)
        if tokenizer is None:
            return "remote"
        try:
            for messages in PARITY_CHATS:
                theirs = await self._remote(replica_url, {"model": model, "messages": messages})
                if tokenizer.render_chat(messages) != theirs:
                    return f"mismatch: chat template output differs ({len(messages)} messages)"
            for prompt in PARITY_PROMPTS:
                theirs = await self._remote(replica_url, {"model": model, "prompt": prompt})
                if tokenizer.encode_prompt(prompt) != theirs:
                    return f"mismatch: prompt {prompt[:20]!r} tokenises differently"
        except (httpx.HTTPError, APIError, KeyError, ValueError) as exc:
            return f"unavailable: {type(exc).__name__}"
        except ChatTemplateError as exc:
            return f"mismatch: {exc}"
        return "ok"
