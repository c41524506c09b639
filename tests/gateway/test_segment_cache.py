"""The routing tier's tokenisation by pieces (gateway/segment_cache.py): the ids of every
rendered chat equal the whole text's, for each byte-level tokenizer we serve, whatever the
messages hold (literal special tokens, partial ones, unicode, whitespace at every edge);
repeated pieces come from the cache; tokenizers whose pieces are not independent are tokenised
whole, and the guard turns the cache off when pieces and whole text ever disagree."""

from __future__ import annotations

import logging
import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from backend_engine.model_loader import resolve_model
from gateway import segment_cache
from gateway.segment_cache import SegmentCache, eligible
from gateway.tokenizer import LocalTokenizer

FRAGMENTS = [
    "Hello", " world", "  two spaces", "\n", "\n\n", "\t", " ", "héllo wörld", "🙂🙂", "日本語の文",
    "123456789", "3.14159", "<|im_start|>", "<|im_end|>", "<|im_start", "|>", "<|endoftext|>",
    "<s>", "</s>", "<|eot_id|>", "[INST]", "'s", "don't", "x" * 300, "def f(x):\n    return x\n",
    "   ", "\r\n", "a\u00a0b", "end. ", "<think>", "</think>",
]


def _content(rng: random.Random) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 12)))


def _chats(rng: random.Random, n: int):
    system = _content(rng) + " You answer from the document. " * 40
    for _ in range(n):
        messages = [{"role": "system", "content": system if rng.random() < 0.7 else _content(rng)}]
        for turn in range(rng.randint(1, 4)):
            messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": _content(rng)})
        if messages[-1]["role"] == "assistant":
            messages.append({"role": "user", "content": _content(rng)})
        yield messages


@pytest.mark.parametrize("model", ["tiny-random", "tiny-random-qwen3", "tiny-random-gemma3",
                                   "tiny-random-phi3"])
def test_ids_by_pieces_equal_the_whole_texts(model):
    local = LocalTokenizer.from_folder(resolve_model(model).folder)
    cache = local.segments
    assert cache.disabled is None, cache.disabled
    rng = random.Random(7)
    for messages in _chats(rng, 150):
        text = local.template.render(messages=messages, add_generation_prompt=True,
                                     **{k: v for k, v in local.special.items() if v is not None})
        for piece_text in (text, _content(rng) + text + _content(rng)):
            assert cache.encode(piece_text) == local.tokenizer.encode(
                piece_text, add_special_tokens=False).ids
    assert cache.disabled is None
    assert cache.hits > cache.misses  # the system prompt and the role names come from the cache


def test_render_chat_goes_through_the_cache():
    local = LocalTokenizer.from_folder(resolve_model("tiny-random").folder)
    messages = [{"role": "system", "content": "A long shared instruction. " * 50},
                {"role": "user", "content": "Hi"}]
    first = local.render_chat(messages)
    hits = local.segments.hits
    assert local.render_chat(messages) == first and local.segments.hits > hits


def _metaspace() -> Tokenizer:
    """A SentencePiece-style tokenizer: only the text's first piece gets a leading '▁'."""
    vocab = {"▁": 0, "a": 1, "b": 2, "▁a": 3, "▁b": 4, "<s>": 5}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁", "b")]))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.add_special_tokens(["<s>"])
    return tokenizer


def _byte_level(**added) -> Tokenizer:
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyzĠ")}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.add_special_tokens([AddedToken("<x>", **added)])
    return tokenizer


def test_tokenizers_whose_pieces_depend_on_each_other_are_tokenised_whole():
    metaspace = _metaspace()
    assert "byte-level" in eligible(metaspace)
    cache = SegmentCache(metaspace)
    assert cache.encode("a<s>b") == metaspace.encode("a<s>b", add_special_tokens=False).ids
    assert cache.hits == cache.misses == 0
    assert eligible(_byte_level()) is None
    assert "not matched as written" in eligible(_byte_level(lstrip=True))
    lowercased = _byte_level()
    lowercased.normalizer = normalizers.Lowercase()
    assert "normaliser" in eligible(lowercased)


def test_the_guard_turns_the_cache_off_when_pieces_and_whole_text_disagree(monkeypatch, caplog):
    monkeypatch.setattr(segment_cache, "eligible", lambda tokenizer: None)
    tokenizer = _metaspace()
    cache = SegmentCache(tokenizer, "metaspace-test")
    whole = tokenizer.encode("a<s>b", add_special_tokens=False).ids
    with caplog.at_level(logging.WARNING, logger="gateway.segment_cache"):
        assert cache.encode("a<s>b") == whole  # by pieces the second "b" would be "▁b"
    assert cache.disabled is not None and "metaspace-test" in caplog.text
    assert cache.encode("a<s>b") == whole


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(segment_cache, "MAX_PIECES", 8)
    monkeypatch.setattr(segment_cache, "MAX_CHARS", 200)
    tokenizer = _byte_level()
    cache = SegmentCache(tokenizer)
    for i in range(50):
        text = "<x>".join("abc"[: 1 + i % 3] * (1 + i % 40) + "z" * j for j in range(3))
        assert cache.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids
        assert len(cache._pieces) <= 8 and cache._chars <= 200
        assert cache._chars == sum(len(p) for p in cache._pieces)


def test_the_longest_added_token_wins_where_two_start_at_one_place():
    tokenizer = _byte_level()
    tokenizer.add_special_tokens(["<x>y", "x>"])
    cache = SegmentCache(tokenizer)
    for text in ("a<x>yb", "a<x>b", "<x>y<x>", "x><x>yx>", "<<x>y>"):
        assert cache.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids, text
    assert cache.disabled is None
