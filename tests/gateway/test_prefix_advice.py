"""Prefix-stability advice on crafted prompt streams, tokenised with the tiny model's real
tokenizer and chat template: volatile fields early in a prompt become advice with the right
position, kind and saving; genuinely different, end-only, stable and chat-turn streams never
do; and no value of a field ever appears in what the advisor reports."""

from __future__ import annotations

import json
import random
import uuid

import pytest

from gateway.prefix_advice import AdviceConfig, PrefixAdvisor
from gateway.tokenizer import LocalTokenizer
from tests.gateway.procs import tokenizer_folder

RULE_LIST = [f"Rule {w}: answer politely, cite the policy section and never guess."
             for w in ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                       "ten", "eleven", "twelve")]
RULES = " ".join(RULE_LIST)
NAMES = ["Alice Martin", "Bob", "Chiara Rossi", "Dmitri", "Eve Tanaka", "Farouk Haddad",
         "Gwen", "Hiroshi Sato"]
QUESTIONS = ["Where is my parcel?", "How do I reset my password?", "Can I change my plan?",
             "What are your opening hours?"]


@pytest.fixture(scope="module")
def tok() -> LocalTokenizer:
    return LocalTokenizer.from_folder(tokenizer_folder())


def chat(tok: LocalTokenizer, system: str, user: str = "Hi") -> list[int]:
    return tok.render_chat([{"role": "system", "content": system}, {"role": "user", "content": user}])


def feed(advisor: PrefixAdvisor, tok: LocalTokenizer, prompts: list[list[int]],
         key: str = "app", model: str = "m") -> list:
    return [advisor.observe(key, model, p, tok) for p in prompts]


def timestamp(rng: random.Random) -> str:
    return (f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} "
            f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}")


def token_index(tok: LocalTokenizer, ids: list[int], marker: str) -> int:
    """The index of the token that completes `marker` in the decoded prompt."""
    return next(k for k in range(len(ids)) if marker in tok.decode(ids[:k + 1]))


def assert_masked(advisor: PrefixAdvisor, values: list[str]) -> None:
    dump = json.dumps(advisor.snapshot(), ensure_ascii=False)
    for value in values:
        for piece in value.split():
            assert piece not in dump, f"{piece!r} leaked into the advice"


def only_advice(advisor: PrefixAdvisor) -> dict:
    rows = advisor.snapshot()
    assert len(rows) == 1, rows
    assert rows[0]["active"]
    return rows[0]


def test_timestamp_at_the_start_of_the_system_prompt_becomes_advice(tok):
    rng = random.Random(1)
    stamps = [timestamp(rng) for _ in range(6)]
    prompts = [chat(tok, f"Today is {ts} UTC. You are the ACME support assistant. {RULES}")
               for ts in stamps]
    advisor = PrefixAdvisor()
    found = feed(advisor, tok, prompts)
    assert found[0] is None  # nothing to compare with yet
    assert all(f is not None for f in found[1:])
    assert [f.active for f in found[1:]] == [False, False, True, True, True]
    assert [f.reported for f in found[1:]] == [0, 0, 3, 1, 1]  # metrics start when it is advice
    row = only_advice(advisor)
    assert row["kind"] == "timestamp"
    position = token_index(tok, prompts[0], "Today is 2")
    assert row["position_tokens"] == position and row["position_block"] == position // 16
    assert row["excerpt"] == ("… <|im_start|>system Today is ⟦####-##-## ##:##:##⟧ UTC. You "
                              "are the ACME …")
    # Moved to the end, the 19-token timestamp leaves every other token shared: whole blocks.
    field_tokens = token_index(tok, prompts[0], stamps[0]) + 1 - position
    assert field_tokens == 19
    assert row["cached_tokens_now"] == 0
    assert row["saving_tokens_per_request"] == (len(prompts[0]) - field_tokens) // 16 * 16
    assert row["occurrences"] == 5 and row["wasted_prefill_tokens"] == 5 * row["saving_tokens_per_request"]
    assert_masked(advisor, stamps)


def test_request_id_user_name_and_uuid_are_each_found(tok):
    rng = random.Random(2)
    cases = {
        "id": [f"req_{rng.getrandbits(40):010x}" for _ in range(5)],
        "word": NAMES[:5],
        "uuid": [str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(5)],
    }
    templates = {
        "id": "Request {} received. You are the ACME support assistant. " + RULES,
        "word": "You are talking to {}. Be kind. You are the ACME support assistant. " + RULES,
        "uuid": ("You are the ACME support assistant. " + " ".join(RULE_LIST[:6])
                 + " Session {} is open. " + " ".join(RULE_LIST[6:])),
    }
    for kind, values in cases.items():
        advisor = PrefixAdvisor()
        prompts = [chat(tok, templates[kind].format(v), rng.choice(QUESTIONS)) for v in values]
        feed(advisor, tok, prompts)
        row = only_advice(advisor)
        assert row["kind"] == kind
        assert row["saving_tokens_per_request"] >= 2 * 16
        assert_masked(advisor, values)
        if kind == "uuid":  # in the middle: the blocks before it are cached today
            position = token_index(tok, prompts[0], "Session " + values[0][0])
            assert row["position_tokens"] == position
            assert row["cached_tokens_now"] == position // 16 * 16 > 0
            assert "⟦########-####-####-####-############⟧" in row["excerpt"]
        if kind == "word":
            assert "⟦▇▇▇⟧" in row["excerpt"] or "⟦▇▇▇ ▇▇▇⟧" in row["excerpt"]


def test_genuinely_different_prompts_never_alarm(tok):
    rng = random.Random(3)
    words = RULES.replace(":", "").replace(",", "").replace(".", "").split()
    prompts = []
    for _ in range(12):  # same opening, then different text of a realistic length
        body = " ".join(rng.choice(words) for _ in range(120))
        prompts.append(chat(tok, f"You are an assistant. {body}", rng.choice(QUESTIONS)))
    advisor = PrefixAdvisor()
    assert feed(advisor, tok, prompts) == [None] * 12
    assert advisor.snapshot() == []


def test_a_long_divergent_passage_before_a_shared_tail_is_not_a_field(tok):
    rng = random.Random(4)
    words = RULES.split()
    prompts = [chat(tok, "Context: " + " ".join(rng.choice(words) for _ in range(60)) + " " + RULES)
               for _ in range(8)]
    advisor = PrefixAdvisor()
    assert feed(advisor, tok, prompts) == [None] * 8


def test_prompts_that_differ_only_at_the_end_are_fine(tok):
    rng = random.Random(5)
    system = f"You are the ACME support assistant. {RULES}"
    prompts = [chat(tok, system, f"{rng.choice(QUESTIONS)} My order is {rng.randint(10**6, 10**7)}.")
               for _ in range(10)]
    advisor = PrefixAdvisor()
    assert feed(advisor, tok, prompts) == [None] * 10


def test_stable_prompts_and_multi_turn_chats_give_no_advice(tok):
    rng = random.Random(6)
    system = f"You are the ACME support assistant. {RULES}"
    advisor = PrefixAdvisor()
    assert feed(advisor, tok, [chat(tok, system, "Hi")] * 6) == [None] * 6
    conversations = [[{"role": "system", "content": system}] for _ in range(3)]
    for turn in range(4):  # three users' conversations growing turn by turn, interleaved
        for messages in conversations:
            messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
            assert advisor.observe("app", "m", tok.render_chat(messages), tok) is None
            messages.append({"role": "assistant", "content": f"Answer {turn}: see section {turn}."})
    assert advisor.snapshot() == []


def test_a_one_off_field_is_never_advice(tok):
    rng = random.Random(7)
    stable = chat(tok, f"Today is Monday. You are the ACME support assistant. {RULES}")
    odd = chat(tok, f"Today is {timestamp(rng)}. You are the ACME support assistant. {RULES}")
    advisor = PrefixAdvisor()
    found = feed(advisor, tok, [stable, odd, stable, stable])
    assert [f is not None for f in found] == [False, True, False, False]
    assert found[1].reported == 0 and not found[1].active
    assert advisor.snapshot() == [] and advisor.active_savings() == {}


def test_variants_that_come_back_stop_counting(tok):
    # Ten fixed variants, more than the prompts the advisor keeps: each variant's first prompt
    # misses the cache at the field; when it comes back the engine likely still holds it.
    products = ["Atlas", "Borealis", "Cygnus", "Draco", "Eridanus", "Fornax", "Grus", "Hydra",
                "Indus", "Lyra"]
    prompts = [chat(tok, f"You support the {p} product. {RULES}") for p in products] * 5
    advisor = PrefixAdvisor()
    found = feed(advisor, tok, prompts)
    assert sum(f is not None for f in found) == 9 and all(f is None for f in found[10:])
    rows = advisor.snapshot()
    assert len(rows) == 1 and rows[0]["kind"] == "word" and not rows[0]["active"]
    assert_masked(advisor, products)


def test_advice_fades_once_the_field_is_fixed(tok):
    rng = random.Random(8)
    config = AdviceConfig(window=8)
    advisor = PrefixAdvisor(config)
    feed(advisor, tok, [chat(tok, f"Now: {timestamp(rng)}. {RULES}") for _ in range(4)])
    assert only_advice(advisor)["active"]
    fixed = chat(tok, f"{RULES} Now: {timestamp(rng)}.")
    feed(advisor, tok, [fixed] * config.window)
    rows = advisor.snapshot()
    assert len(rows) == 1 and not rows[0]["active"] and rows[0]["recent_occurrences"] == 0
    assert advisor.active_savings() == {}


def test_names_that_vary_next_to_the_field_are_masked_in_the_excerpt(tok):
    rng = random.Random(9)
    prompts = []
    for name in ("Quentin", "Quentin", "Ursula", "Ursula", "Valentina", "Valentina"):
        prompts.append(chat(tok, f"Customer {name} asks. Today is {timestamp(rng)}. {RULES}"))
    advisor = PrefixAdvisor()
    feed(advisor, tok, prompts)
    row = only_advice(advisor)
    assert row["occurrences"] == 3  # one per pair of same-name prompts
    assert "Customer ▇▇▇ asks. Today is ⟦" in row["excerpt"]
    assert_masked(advisor, ["Quentin", "Ursula", "Valentina"])


def test_keys_models_and_salts_are_kept_apart(tok):
    rng = random.Random(10)
    prompts = [chat(tok, f"Today is {timestamp(rng)}. {RULES}") for _ in range(6)]
    advisor = PrefixAdvisor()
    for i, p in enumerate(prompts):  # alternating keys: each key sees every other prompt
        advisor.observe(f"key{i % 2}", "m", p, tok)
    assert advisor.active_savings() == {}  # two occurrences per key: below the threshold
    for i, p in enumerate(prompts):  # alternating salts: no prompt shares a cache with the last
        assert advisor.observe("salted", "m", p, tok, salt=f"s{i}") is None


def test_memory_is_bounded(tok):
    config = AdviceConfig(max_entries=8, recent_prompts=3, max_prompt_tokens=64)
    advisor = PrefixAdvisor(config)
    long_prompt = chat(tok, RULES * 4)
    for i in range(40):
        advisor.observe(f"key{i}", "m", long_prompt[:-1] + [i], tok)
        advisor.observe("busy", "m", [i] + long_prompt, tok)
    size = advisor.size()
    assert size.entries == 8 and size.prompts <= 8 * 3
    assert size.prompt_bytes == size.prompts * 64 * 4  # only each prompt's head is kept


def test_token_ids_beyond_32_bits_are_skipped(tok):
    advisor = PrefixAdvisor()
    assert advisor.observe("app", "m", [1, 2, 2**40], tok) is None
    assert advisor.size().entries == 0
