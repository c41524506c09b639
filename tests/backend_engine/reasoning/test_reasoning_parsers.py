"""Reasoning parsers on text: `<think>…</think>` split from the answer however the prompt left the
model (a block the template opened, one it closed, none), streamed deltas that add up to the
final split, the registry's names and detection by chat template."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend_engine.reasoning import (PARSERS, ReasoningStream, check_name, detect,
                                      extract_reasoning, parser_for)

R1, QWEN3 = PARSERS["deepseek_r1"](), PARSERS["qwen3"]()
OPEN = "<|im_start|>assistant\n<think>\n"  # the template opened the block (R1, Qwen3-Thinking)
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking false
PLAIN = "<|im_start|>assistant\n"


@pytest.mark.parametrize("parser,prompt,output,expected", [
    (R1, OPEN, "Let me see.\n</think>\n\nThe answer is 4.", ("Let me see.\n", "The answer is 4.")),
    (R1, PLAIN, "<think>Hmm.</think>Four.", ("Hmm.", "Four.")),  # R1-0528 opens it itself
    (R1, PLAIN, "Hmm, still thinking", ("Hmm, still thinking", None)),  # cut off: all reasoning
    (R1, CLOSED, "Four.", (None, "Four.")),
    (QWEN3, PLAIN, "<think>\nAdd them.\n</think>\n\n4", ("\nAdd them.\n", "4")),
    (QWEN3, PLAIN, "Just 4.", (None, "Just 4.")),  # never opened: content
    (QWEN3, OPEN, "Add.</think>4", ("Add.", "4")),
    (QWEN3, CLOSED, "4 <think> is a tag", (None, "4 <think> is a tag")),
    (QWEN3, PLAIN, "<think></think>4", (None, "4")),
    (QWEN3, PLAIN, "<think>cut off", ("cut off", None)),
])
def test_split(parser, prompt, output, expected):
    assert extract_reasoning(parser, output, prompt) == expected


@settings(max_examples=60, deadline=None)
@given(parser=st.sampled_from([R1, QWEN3]), prompt=st.sampled_from([OPEN, CLOSED, PLAIN]),
       reasoning=st.text("ab </>thkin\n", max_size=12), answer=st.text("ab <{}\n", max_size=12),
       opened=st.booleans(), closed=st.booleans(), cuts=st.lists(st.integers(0, 40), max_size=6))
def test_streamed_deltas_add_up_to_the_final_split(parser, prompt, reasoning, answer, opened,
                                                   closed, cuts):
    text = ("<think>" if opened else "") + reasoning + ("</think>" if closed else "") + answer
    stream = ReasoningStream(parser, prompt)
    sent = ["", ""]
    points = sorted({min(c, len(text)) for c in cuts}) + [len(text)]
    start = 0
    for i, point in enumerate(points):
        r, c = stream.feed(text[start:point], final=i == len(points) - 1)
        sent[0] += r
        sent[1] += c
        start = point
    final_reasoning, final_content = extract_reasoning(parser, text, prompt)
    assert sent == [final_reasoning or "", final_content or ""]


def test_the_grammar_waits_unless_the_prompt_closed_the_reasoning():
    assert R1.reasoning_may_follow(OPEN) and R1.reasoning_may_follow(PLAIN)
    assert QWEN3.reasoning_may_follow(PLAIN)  # the model may open a block itself
    assert not R1.reasoning_may_follow(CLOSED) and not QWEN3.reasoning_may_follow(CLOSED)


def test_names_and_detection_by_template():
    assert set(PARSERS) == {"deepseek_r1", "qwen3"}
    with pytest.raises(ValueError, match="unknown reasoning parser 'deepseek'.*deepseek_r1"):
        check_name("deepseek")
    assert parser_for("none") is None and parser_for("qwen3").name == "qwen3"
    qwen3 = "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    r1 = "{{ '<｜Assistant｜><think>\\n' }}"
    assert detect(qwen3, PLAIN) == "qwen3"
    assert detect(r1, "<｜User｜>Hi<｜Assistant｜><think>\n") == "deepseek_r1"
    assert detect("{{ messages }}", PLAIN) is None  # no think tags: no parser
    assert detect("{{ content.split('</think>')[-1] }}", PLAIN) is None  # ambiguous
    assert parser_for("auto", "{{ messages }}", PLAIN) is None
