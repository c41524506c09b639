"""The prompt's token ids, as the replica will see them, tokenised locally whenever the gateway
can: with a `--tokenizer` folder where given, else with the tokenizer kvgate replicas serve
(replica_tokenizers.py); only models whose replicas serve none are tokenised through a
replica's `/tokenize` (remote_tokenize.py). Also the parity check of the local tokenizer
against each replica, and the one-line mode of each model for the logs."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import httpx

from gateway.remote_tokenize import RemoteTokenizer
from gateway.replica_tokenizers import ReplicaTokenizers
from gateway.tokenizer import ChatTemplateError, LocalTokenizer, TokenizerUnavailable
from protocol.chat import ChatCompletionRequest
from protocol.errors import APIError, bad_request

Candidates = Sequence[tuple[str, int]]  # replicas that may tokenise: (URL, requests in flight)

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
    def __init__(self, folders: dict[str, str], client: httpx.AsyncClient,
                 fetch_from_replicas: bool = True) -> None:
        self.folders = folders
        self.fetch_from_replicas = fetch_from_replicas
        self.fetched = ReplicaTokenizers(client)
        self.remote = RemoteTokenizer(client)
        self._from_folder: dict[str, LocalTokenizer | None] = {}

    def folder_tokenizer(self, model: str) -> LocalTokenizer | None:
        """The tokenizer of `--tokenizer MODEL=FOLDER` (or `*=FOLDER`, or a model id that is a
        folder), which wins over anything the replicas serve."""
        if model not in self._from_folder:
            folder = self.folders.get(model) or self.folders.get("*")
            if folder is None and Path(model).is_dir():
                folder = model
            tokenizer = None
            if folder is not None:
                try:
                    tokenizer = LocalTokenizer.from_folder(folder)
                except (TokenizerUnavailable, OSError, ValueError) as exc:
                    log.warning("no local tokenizer for %s (%s): using replicas' /tokenize", model, exc)
            self._from_folder[model] = tokenizer
        return self._from_folder[model]

    def local(self, model: str) -> LocalTokenizer | None:
        return self.folder_tokenizer(model) or self.fetched.get(model)

    def mode(self, model: str) -> str:
        """How `model` is tokenised, in words for the logs and the dashboard."""
        if (tokenizer := self.folder_tokenizer(model)) is not None:
            return f"local (--tokenizer folder {tokenizer.source})"
        if (digest := self.fetched.digest(model)) is not None:
            return f"local (tokenizer from the replicas, {digest[:19]})"
        return "remote (/tokenize on the least-loaded replica of the model)"

    async def sync_from_replica(self, model: str, replica_url: str, block_size: int) -> str | None:
        """Fetch or confirm the model's tokenizer from a replica (when no folder wins): None, or
        the refusal ('mismatch: …') that makes the replica's parity."""
        if not self.fetch_from_replicas or self.folder_tokenizer(model) is not None:
            return None
        verdict = await self.fetched.sync(model, replica_url, block_size)
        if verdict.startswith("unavailable"):
            log.warning("cannot fetch %s's tokenizer from %s: %s", model, replica_url, verdict)
        return verdict if verdict.startswith("mismatch") else None

    async def chat(self, req: ChatCompletionRequest, candidates: Candidates) -> list[int]:
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
        return await self.remote.tokens(candidates, body)

    async def prompt(self, model: str, prompt: str | list[int], candidates: Candidates) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        tokenizer = self.local(model)
        if tokenizer is not None:
            return tokenizer.encode_prompt(prompt)
        return await self.remote.tokens(candidates, {"model": model, "prompt": prompt})

    async def check_parity(self, model: str, replica_url: str) -> str:
        """'ok', 'mismatch: …', 'remote' (no local tokenizer) or 'unavailable'."""
        tokenizer = self.local(model)
        if tokenizer is None:
            return "remote"
        try:
            for messages in PARITY_CHATS:
                theirs = await self.remote.post(replica_url, {"model": model, "messages": messages})
                if tokenizer.render_chat(messages) != theirs:
                    return f"mismatch: chat template output differs ({len(messages)} messages)"
            for prompt in PARITY_PROMPTS:
                theirs = await self.remote.post(replica_url, {"model": model, "prompt": prompt})
                if tokenizer.encode_prompt(prompt) != theirs:
                    return f"mismatch: prompt {prompt[:20]!r} tokenises differently"
        except (httpx.HTTPError, APIError, KeyError, ValueError) as exc:
            return f"unavailable: {type(exc).__name__}"
        except ChatTemplateError as exc:
            return f"mismatch: {exc}"
        return "ok"
