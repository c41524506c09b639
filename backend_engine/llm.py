"""The offline API: LLM(...).generate(prompts, SamplingParams) and chat(messages)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from backend_engine.chat import encode_prompt, render_chat
from backend_engine.cli_args import from_mapping
from backend_engine.config import EngineConfig
from backend_engine.engine import LLMEngine
from backend_engine.outputs import RequestOutput
from backend_engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = "default", **engine_args):
        """engine_args: EngineConfig's fields, or vLLM's `speculative_config` and
        `kv_transfer_config` mappings, read as `kvgate engine` reads its flags."""
        kwargs, = from_mapping([EngineConfig], {"model": model, **engine_args})
        self.engine = LLMEngine(EngineConfig(**kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Seq[str] | Seq[list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 cache_salt: str | None = None,
                 priority: int | Seq[int] = 0) -> list[RequestOutput]:
        """Run every prompt to completion (batched by the scheduler); outputs in input order.
        `priority` (one, or one per prompt): lower values are served first, as in vLLM."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [encode_prompt(self.tokenizer, p) if isinstance(p, str) else list(p)
                       for p in prompts]
        return self._run(token_lists, params, cache_salt,
                         [p if isinstance(p, str) else None for p in prompts], priority)

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | Seq[SamplingParams] | None = None,
             chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_lists = [render_chat(self.tokenizer, c, add_generation_prompt, chat_template_kwargs)
                       for c in conversations]
        return self._run(token_lists, params, None, [None] * len(token_lists))

    def _run(self, token_lists, params, cache_salt, texts, priority=0) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        params_list = list(params) if isinstance(params, Seq) else [params] * len(token_lists)
        if len(params_list) != len(token_lists):
            raise ValueError("give one SamplingParams, or one per prompt")
        priorities = list(priority) if isinstance(priority, Seq) else [priority] * len(token_lists)
        if len(priorities) != len(token_lists):
            raise ValueError("give one priority, or one per prompt")
        for tokens, p, prio in zip(token_lists, params_list, priorities):  # all before any
            self.engine.check_request(tokens, p, cache_salt, prio)
        ids = []
        for tokens, p, text, prio in zip(token_lists, params_list, texts, priorities):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, tokens, p, cache_salt=cache_salt, prompt=text,
                                    priority=prio)
            ids.append(request_id)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
