"""Request fields of vLLM's and SGLang's OpenAI schemas that are not (yet) fields of ours.

Routers written for those engines send them: SGLang's model gateway re-serialises every request
with SGLang's defaults (`no_stop_trim`, `separate_reasoning`, `return_hidden_states`, …). A field
that maps onto our sampling is moved onto it; one whose value asks for nothing (its default) or
that only informs (routing hints, labels) is dropped, counted in `IGNORED` and logged at debug;
one that asks for something we cannot do is refused with a 400 naming it. A field in none of
these schemas stays an `unknown_parameter` 400, as OpenAI answers.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

from protocol.errors import unsupported

log = logging.getLogger(__name__)

_ANY = object()
# Dropped when the value is one of these (None always is): asking for nothing.
NOOP: dict[str, tuple] = {
    # vLLM
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (), "truncation_side": (), "allowed_token_ids": (), "bad_words": ([],),
    "prompt_logprobs": (), "logprob_token_ids": (), "echo": (False,), "add_special_tokens": (False,),
    "documents": (), "chat_template": (), "media_io_kwargs": (), "mm_processor_kwargs": (),
    "structured_outputs": (), "return_tokens_as_token_ids": (False,),
    "return_weight_versions": (False,), "return_token_offsets": (False,), "return_prompt_text": (False,),
    "return_mm_kwargs": (False,), "routed_experts_prompt_start": (0,), "kv_transfer_params": (),
    "ec_transfer_params": (), "vllm_xargs": ({},), "repetition_detection": (), "thinking_token_budget": (),
    "watermarking": (), "prompt_embeds": (),
    # SGLang
    "return_hidden_states": (False,), "return_routed_experts": (False,), "routed_experts_start_len": (0,),
    "return_cached_tokens_details": (False,), "json_schema": (), "regex": (), "ebnf": (), "stop_regex": (),
    "lora_path": (), "session_params": (), "custom_logit_processor": (), "custom_params": ({},),
    "images_config": (), "bootstrap_host": (), "bootstrap_port": (), "bootstrap_room": (),
}
# Dropped whatever the value: they steer routing or presentation we do not have (reasoning is
# always separated and streamed apart when the replica runs a reasoning parser), or label the
# request.
ADVISORY = frozenset({
    "separate_reasoning", "stream_reasoning", "rid", "extra_key", "custom_labels", "session_id",
    "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank", "ngram_corpus_id",
    "stream_interval", "mm_payload", "include_reasoning",
})

IGNORED: Counter[str] = Counter()  # field -> requests that carried it, this process
_lock = threading.Lock()


def split_extras(fields: dict[str, Any], data: Any) -> Any:
    """`data` with the known extras mapped or dropped; `fields` are the model's own fields."""
    if not isinstance(data, dict) or not (data.keys() - fields.keys()):
        return data
    out = dict(data)
    ignored = []
    if "no_stop_trim" in out and "no_stop_trim" not in fields:
        if out.pop("no_stop_trim") is True:  # SGLang: keep the matched stop string
            out.setdefault("include_stop_str_in_output", True)
    if "max_completion_tokens" in out and "max_completion_tokens" not in fields:
        value = out.pop("max_completion_tokens")  # /v1/completions: the chat name of max_tokens
        if value is not None:
            out.setdefault("max_tokens", value)
    for name in list(out.keys() - fields.keys()):
        value = out[name]
        if name in ADVISORY or name in NOOP and (value is None or _noop(value, NOOP[name])):
            del out[name]
            ignored.append(name)
        elif name in NOOP:
            raise unsupported(name, f"'{name}' = {value!r}")
    if ignored:
        with _lock:
            IGNORED.update(ignored)
        log.debug("ignored request fields of other engines' schemas: %s", ", ".join(sorted(ignored)))
    return out


def _noop(value: Any, accepted: tuple) -> bool:
    return any(type(value) is type(a) and value == a for a in accepted)
