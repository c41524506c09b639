"""Tiny random-weight models whose chat templates think as real reasoning models' do: a Qwen3-like
one (the `enable_thinking` switch closes an empty block when false) and a DeepSeek-R1-like one
(the generation prompt opens `<think>`). They share the tiny model's weights and tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

_TURNS = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'].split('</think>')[-1] + '<|im_end|>\\n' }}{% endfor %}")
QWEN3_TEMPLATE = _TURNS + (
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")
R1_TEMPLATE = _TURNS + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"


def think_model(root: Path, name: str, template: str) -> Path:
    """A folder holding the tiny model with `template` as its chat template."""
    from backend_engine.model_loader import resolve_model

    source = resolve_model("tiny-random").folder
    folder = root / name
    folder.mkdir(parents=True)
    for file in source.iterdir():
        if file.name == "model.safetensors":
            (folder / file.name).symlink_to(file)
        elif file.name != "chat_template.jinja":
            shutil.copy(file, folder / file.name)
    (folder / "chat_template.jinja").write_text(template)
    return folder
