"""The most of a workload's prompt tokens any prefix cache could serve: every prompt looked up
against all earlier ones, nothing ever evicted. Two ceilings: reuse by whole blocks (a lookup by
block hash, as vLLM's) and reuse by token (SGLang's radix cache, llama.cpp's slots, and kvgate's
partial blocks). A server's measured cached-token ratio is read against them: eviction and
routing are what separate it from its ceiling."""

from __future__ import annotations

from collections.abc import Sequence


def chat_prompts(jobs: Sequence, tokenizer) -> list[list[int]]:
    """The jobs' chat prompts (one user message each) as a server tokenises them: the model's
    chat template, then the tokenizer."""
    return [tokenizer(tokenizer.apply_chat_template(
        [{"role": "user", "content": spec.prompt}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)["input_ids"] for job in jobs for stage in job.stages for spec in stage]


def cache_ceilings(prompts: Sequence[Sequence[int]], block_size: int = 16) -> dict[str, float]:
    """{'whole_blocks': ratio, 'by_token': ratio} of prompt tokens; a lookup never serves a
    prompt's last token (it must yield logits)."""
    total = sum(len(p) for p in prompts)
    if not total:
        return {"whole_blocks": 0.0, "by_token": 0.0}
    blocks: set[tuple[int, ...]] = set()
    trie: dict = {}
    whole = by_token = 0
    for p in prompts:
        usable = len(p) - 1
        n = 0
        while (n + 1) * block_size <= usable and tuple(p[:(n + 1) * block_size]) in blocks:
            n += 1
        whole += n * block_size
        node, depth = trie, 0
        while depth < usable and p[depth] in node:
            node, depth = node[p[depth]], depth + 1
        by_token += depth
        for i in range(len(p) // block_size):
            blocks.add(tuple(p[:(i + 1) * block_size]))
        node = trie
        for t in p:
            node = node.setdefault(t, {})
    return {"whole_blocks": round(whole / total, 4), "by_token": round(by_token / total, 4)}
