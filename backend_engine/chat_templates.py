"""Chat templates for checkpoints that carry none, by `model_type`: the turn format the family
was trained on. A GGUF file converted without `tokenizer.chat_template` (Gemma 3 270M's) would
otherwise serve only /v1/completions; a template in the checkpoint always wins.

Gemma: `<start_of_turn>user` / `<start_of_turn>model` turns, each closed by `<end_of_turn>`,
which also ends generation; system (and developer) messages open the first user turn, tool
results are user turns (the format has no tool role)."""

from __future__ import annotations

_GEMMA = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- set text = m['content'] if m['content'] is string else "
    "(m['content'] or []) | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join('\\n') -%}"
    "{%- if m['role'] in ('system', 'developer') -%}"
    "{%- set ns.system = ns.system + text + '\\n\\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' }}"
    "{%- if m['role'] != 'assistant' -%}{{ ns.system }}{%- set ns.system = '' -%}{%- endif -%}"
    "{{ text | trim + '<end_of_turn>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# model_type → (template, the token that ends a turn, which ends generation too)
FALLBACK: dict[str, tuple[str, str]] = {
    "gemma3_text": (_GEMMA, "<end_of_turn>"),
}


def fill_missing_template(tokenizer, generation_config, model_type: str) -> None:
    """Give a tokenizer without a chat template its family's, and stop generation at the
    template's end of turn; a no-op for a checkpoint with a template, or a family without one
    here."""
    if tokenizer.chat_template is not None or model_type not in FALLBACK:
        return
    template, end_of_turn = FALLBACK[model_type]
    tokenizer.chat_template = template
    end_id = tokenizer.convert_tokens_to_ids(end_of_turn)
    eos = generation_config.eos_token_id
    eos = list(eos) if isinstance(eos, list) else [] if eos is None else [eos]
    if end_id is not None and end_id != tokenizer.unk_token_id and end_id not in eos:
        generation_config.eos_token_id = eos + [end_id]
