"""Turns a step's logits into tokens: grammar masks, bias, penalties, min_tokens, temperature,
top-k/top-p/min-p, greedy or seeded sampling, and logprobs (of the masked distribution).
Vectorised over the batch; per-row loops only for seeded rows (each has its own generator).
Draws are by inverse CDF with one uniform per row, over a partial top-k of the vocabulary when
the filters allow it: a full sort and a random number per vocabulary entry cost a large share
of a step at a large batch of a large vocabulary.

Everything runs on the logits' device: on CUDA only the sampled ids (and requested logprobs)
come back to the host. The uniforms come from CPU generators (the engine's, or a seeded
request's own) and go to the device, one float a row, so a seed draws the same tokens on
every device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend_engine.argmax import argmax_rows
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


NUCLEUS_CANDIDATES = 1024  # top-p looks for its nucleus among this many likeliest tokens first


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
        tokens = tokens.to(logits.device)
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
        """The distribution sampling draws from (temperature, then min-p, top-k, top-p), dense
        over the vocabulary and unnormalised where filters dropped tokens."""
        probs, candidates = self._filtered(logits, rows)
        if candidates is None:
            return probs
        return torch.zeros_like(logits, dtype=probs.dtype).scatter_(1, candidates, probs)

    @staticmethod
    def _apply_bias_and_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab, device = logits.shape[1], logits.device
        for i, row in enumerate(rows):
            p = row.params
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if 0 <= t < vocab], dtype=torch.long,
                                   device=device)
                vals = torch.tensor([float(p.logit_bias[t]) for t in p.logit_bias
                                     if 0 <= t < vocab], device=device)
                logits[i].index_add_(0, ids, vals)
            if row.blocked_token_ids:
                kept = logits[i].clone() if row.grammar_mask is not None else None
                blocked = torch.tensor([t for t in row.blocked_token_ids if 0 <= t < vocab],
                                       dtype=torch.long, device=device)
                logits[i, blocked] = float("-inf")
                if kept is not None and bool(torch.isinf(logits[i]).all()):
                    logits[i] = kept  # the grammar allows nothing else: it ends before min_tokens
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
                                    dtype=torch.long, device=device)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                              vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
                ids, counts = torch.tensor(row.output_token_ids, device=device).unique(
                    return_counts=True)
                logits[i, ids] -= p.frequency_penalty * counts.float() + p.presence_penalty
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy = [r.params.greedy for r in rows]
        tokens = argmax_rows(logits)
        if all(greedy):
            return tokens
        drawn = [i for i, g in enumerate(greedy) if not g]
        sub_rows = [rows[i] for i in drawn]
        drawn_index = torch.tensor(drawn, device=logits.device)
        probs, candidates = self._filtered(logits[drawn_index], sub_rows)
        if candidates is not None:  # draw in token-id order, as from the dense distribution:
            candidates, order = candidates.sort(dim=1)  # a row's draw must not depend on
            probs = probs.gather(1, order)  # which path its batch neighbours forced
        picks = self._draw(probs, sub_rows)
        if candidates is not None:
            picks = candidates.gather(1, picks.unsqueeze(1)).squeeze(1)
        tokens[drawn_index] = picks
        return tokens

    def _draw(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One index per row, drawn by inverse CDF from (unnormalised) non-negative weights:
        one uniform per row, so a seeded row's draw depends only on its own generator."""
        u = torch.rand(len(rows), generator=self.generator)
        for i, row in enumerate(rows):
            if row.generator is not None:
                u[i] = torch.rand(1, generator=row.generator)
        u = u.to(probs.device, non_blocking=True)
        cdf = probs.cumsum(dim=-1)
        target = (u * cdf[:, -1]).unsqueeze(1)
        index = torch.searchsorted(cdf, target, right=True).squeeze(1)
        return index.clamp_(max=probs.shape[1] - 1)

    def _filtered(self, logits: torch.Tensor, rows: list[SamplingRow]
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The distribution sampling draws from (temperature, then min-p, top-k, top-p), as
        dense probabilities, or as the probabilities of candidate token ids [rows, k] when
        every row's top-k / top-p support lies within its k most likely tokens: a partial
        top-k instead of sorting the whole vocabulary (far cheaper at a large vocabulary)."""
        probs = self._tempered(logits, rows)
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        vocab, device = probs.shape[1], probs.device
        if not any(k > 0 for k in top_k) and all(p >= 1.0 for p in top_p):
            return probs, None
        # each row's support is within its first `width` ranks: top-k's k, else a guess for
        # the nucleus that is checked below; a row with neither filter needs the whole vocab
        widths = [k if k > 0 else (NUCLEUS_CANDIDATES if p < 1.0 else vocab)
                  for k, p in zip(top_k, top_p)]
        width = min(vocab, max(widths))
        values, order = probs.topk(width, dim=-1) if width < vocab else probs.sort(
            dim=-1, descending=True)
        ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=device).unsqueeze(1)
        drop = torch.arange(width, device=device).unsqueeze(0) >= ks
        kept = values.masked_fill(drop, 0.0)
        # top-k's mass is its kept values; without top-k the mass is the whole row's
        mass = torch.where(ks.squeeze(1) < vocab, kept.sum(dim=-1), probs.sum(dim=-1))
        kept = kept / mass.unsqueeze(1)
        # top-p over what top-k kept: the smallest prefix reaching the mass (at least one)
        cum = kept.cumsum(dim=-1)
        top_p_t = torch.tensor(top_p, device=device)
        drop |= (cum - kept) >= top_p_t.unsqueeze(1)
        if width < vocab:
            uncovered = (ks.squeeze(1) > width) & (cum[:, -1] < top_p_t)
            if bool(uncovered.any()):  # a flat distribution: the nucleus is wider than guessed
                return self._filtered_dense(probs, rows)
        return values.masked_fill(drop, 0.0), order

    @staticmethod
    def _tempered(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Probabilities after temperature and min-p (before top-k / top-p)."""
        temps = torch.tensor([max(r.params.temperature, 1e-5) for r in rows],
                             device=logits.device)
        probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
        min_p = [r.params.min_p for r in rows]
        if any(min_p):
            threshold = torch.tensor(min_p, device=logits.device).unsqueeze(1) \
                * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def _filtered_dense(self, probs: torch.Tensor, rows: list[SamplingRow]
                        ) -> tuple[torch.Tensor, None]:
        """top-k / top-p by a full sort (the general case), as dense probabilities."""
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        vocab, device = probs.shape[1], probs.device
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=device).unsqueeze(1)
        drop = torch.arange(vocab, device=device).unsqueeze(0) >= ks
        kept = sorted_probs.masked_fill(drop, 0.0)
        kept = kept / kept.sum(dim=-1, keepdim=True)
        drop |= (kept.cumsum(dim=-1) - kept) >= torch.tensor(top_p, device=device).unsqueeze(1)
        return torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0)), None
