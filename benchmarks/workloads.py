"""Deterministic prompt builders shared by the engine benchmarks."""

from __future__ import annotations

import random

WORDS = ("river market engine window garden silver quiet people letter mountain system paper "
         "history yellow number travel winter signal forest coffee bridge music harbour station "
         "teacher science ocean village morning question animal company picture language "
         "problem country family summer kitchen doctor student energy reason planet").split()


def text_of_tokens(tokenizer, num_tokens: int, seed: int) -> str:
    """A sentence-like text of about num_tokens tokens (exact length is not critical)."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < num_tokens:
        words.extend(rng.choice(WORDS) for _ in range(8))
        words[-1] += "."
    return " ".join(words)


def token_prompts(tokenizer, count: int, num_tokens: int, seed: int = 0) -> list[list[int]]:
    """count distinct prompts of exactly num_tokens tokens."""
    return [tokenizer.encode(text_of_tokens(tokenizer, num_tokens + 8, seed + i))[:num_tokens]
            for i in range(count)]
