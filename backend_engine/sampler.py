"""Turns a step's logits into tokens: grammar masks, bias, penalties, min_tokens, temperature,
top-k/top-p/min-p, greedy or seeded sampling, and logprobs (of the masked distribution). Vectorised over the batch; per-row loops only
for seeded rows (each has its own generator)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend_engine.sampling_params import SamplingParams
from backend_engine.structured.bitmask import MaskRow, apply_grammar_masks


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    blocked_token_ids: list[int]  # e.g. EOS and stop ids while output < min_tokens
    grammar_mask: MaskRow | None = None  # structured outputs: the tokens the grammar allows


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None = None  # logprob of each sampled token
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        return self.sample_processed(self.process(logits, rows), rows)

    def sample_processed(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample from logits that already went through process()."""
        tokens = self._sample(logits, rows)
        return self.with_logprobs(SamplerOutput(tokens.tolist()), logits, tokens, rows)

    @staticmethod
    def with_logprobs(out: SamplerOutput, logits: torch.Tensor, tokens: torch.Tensor,
                      rows: list[SamplingRow]) -> SamplerOutput:
        """Fill logprobs of the chosen tokens (and the top ones) from processed logits."""
        want = max((r.params.logprobs for r in rows if r.params.logprobs is not None),
                   default=None)
        if want is None:
            return out
        logprobs = torch.log_softmax(logits, dim=-1)
        out.logprobs = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        if want > 0:
            top = torch.topk(logprobs, want, dim=-1)
            out.top_ids, out.top_logprobs = top.indices.tolist(), top.values.tolist()
        return out

    def process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Grammar masks, logit bias, blocked tokens and penalties (before temperature)."""
        logits = logits.float()
        apply_grammar_masks(logits, [r.grammar_mask for r in rows])
        return self._apply_bias_and_penalties(logits, rows)

    def probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution sampling draws from: temperature, then min-p, top-k, top-p."""
        temps = torch.tensor([max(r.params.temperature, 1e-5) for r in rows])
        return self._filter(torch.softmax(logits / temps.unsqueeze(1), dim=-1), rows)

    @staticmethod
    def _apply_bias_and_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab = logits.shape[1]
        for i, row in enumerate(rows):
            p = row.params
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if 0 <= t < vocab], dtype=torch.long)
                vals = torch.tensor([float(p.logit_bias[t]) for t in p.logit_bias
                                     if 0 <= t < vocab])
                logits[i].index_add_(0, ids, vals)
            if row.blocked_token_ids:
                kept = logits[i].clone() if row.grammar_mask is not None else None
                logits[i, [t for t in row.blocked_token_ids if 0 <= t < vocab]] = float("-inf")
                if kept is not None and bool(torch.isinf(logits[i]).all()):
                    logits[i] = kept  # the grammar allows nothing else: it ends before min_tokens
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
                                    dtype=torch.long)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                              vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
                ids, counts = torch.tensor(row.output_token_ids).unique(return_counts=True)
                logits[i, ids] -= p.frequency_penalty * counts.float() + p.presence_penalty
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy = torch.tensor([r.params.greedy for r in rows])
        tokens = logits.argmax(dim=-1)
        if bool(greedy.all()):
            return tokens
        probs = self.probs(logits, rows)
        # Exponential race (Gumbel-max in probability space): argmax(p / E), E ~ Exp(1).
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i].exponential_(generator=row.generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, tokens, sampled)

    @staticmethod
    def _filter(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        if any(min_p):
            threshold = torch.tensor(min_p).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            vocab = probs.shape[1]
            ks = torch.tensor([k if k > 0 else vocab for k in top_k]).unsqueeze(1)
            ranks = torch.arange(vocab).unsqueeze(0)
            drop = ranks >= ks
            kept = sorted_probs.masked_fill(drop, 0.0)
            kept = kept / kept.sum(dim=-1, keepdim=True)
            # top-p over what top-k kept: the smallest prefix reaching the mass (at least one)
            drop |= (kept.cumsum(dim=-1) - kept) >= torch.tensor(top_p).unsqueeze(1)
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
        return probs
