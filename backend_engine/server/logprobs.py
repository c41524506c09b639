"""Engine token logprobs → OpenAI's two shapes: chat (`content: [{token, logprob, bytes,
top_logprobs}]`) and legacy completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""

from __future__ import annotations

from collections.abc import Sequence

from backend_engine.outputs import TokenLogprob
from protocol.chat import ChoiceLogprobs, TokenLogprobEntry, TopLogprob
from protocol.completions import LegacyLogprobs


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(items: Sequence[TokenLogprob] | None, num_top: int) -> ChoiceLogprobs | None:
    if items is None:
        return None
    content = [
        TokenLogprobEntry(
            token=lp.token,
            logprob=lp.logprob,
            bytes=_bytes(lp.token),
            top_logprobs=[TopLogprob(token=t, logprob=v, bytes=_bytes(t)) for _, t, v in lp.top[:num_top]],
        )
        for lp in items
    ]
    return ChoiceLogprobs(content=content, refusal=None)


def legacy_logprobs(items: Sequence[TokenLogprob | None], num_top: int, text_offset: int,
                    unscored_token: str = "") -> LegacyLogprobs:
    """`text_offset` is where the first token's text starts in the choice's returned text;
    `unscored_token` is the text of the first prompt token, which has no logprob."""
    out = LegacyLogprobs()
    offset = text_offset
    for lp in items:
        if lp is None:
            out.tokens.append(unscored_token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(unscored_token)
            continue
        out.tokens.append(lp.token)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({t: v for _, t, v in lp.top[:num_top]} if num_top else None)
        out.text_offset.append(offset)
        offset += len(lp.token)
    return out


def merge_legacy(a: LegacyLogprobs | None, b: LegacyLogprobs) -> LegacyLogprobs:
    if a is None:
        return b
    return LegacyLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )
