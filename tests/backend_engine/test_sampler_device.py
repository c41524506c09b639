"""The sampler runs on the logits' device and draws what the host draws: every feature at once
(greedy, temperature, top-k, top-p, min-p, penalties, bias, blocked ids, a grammar mask,
logprobs, seeded rows) gives the same tokens on each device as on CPU tensors, with logprobs
within float tolerance. Here that device is the CPU; on a GPU machine (benchmarks/gpu_check.sh)
the CUDA case runs too (without grammar rows where its image lacks xgrammar)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from backend_engine.sampler import Sampler, SamplingRow
from backend_engine.sampling_params import SamplingParams
from backend_engine.structured.bitmask import MaskRow, StepBitmask

VOCAB = 3000
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
HAS_XGRAMMAR = importlib.util.find_spec("xgrammar") is not None

PARAMS = [
    dict(temperature=0.0, logprobs=3),
    dict(temperature=0.8, seed=7),
    dict(temperature=1.0, top_k=20, seed=8, logprobs=0),
    dict(temperature=0.7, top_p=0.9, seed=9),
    dict(temperature=1.3, top_p=0.999, seed=10),  # a nucleus wider than the candidate guess
    dict(temperature=1.0, min_p=0.05, seed=11),
    dict(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4,
         seed=12),
    dict(temperature=1.0, logit_bias={5: 8.0, 17: -100.0}, seed=13, logprobs=2),
    dict(temperature=1.0),  # drawn from the engine's generator
    dict(temperature=0.0, repetition_penalty=1.2),
]


def _rows(mask_step: StepBitmask | None) -> list[SamplingRow]:
    rows = []
    for i, kw in enumerate(PARAMS):
        params = SamplingParams(max_tokens=8, **kw)
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None \
            else None
        rows.append(SamplingRow(params, [1, 2, 3, 40 + i], [50, 50, 60 + i], generator,
                                [7, 8] if i % 3 == 0 else []))
    if mask_step is not None:
        rows[3].grammar_mask = MaskRow(mask_step, 0)
        rows[0].grammar_mask = MaskRow(mask_step, 1)
    return rows


def _mask_step() -> StepBitmask:
    """Two grammar rows: tokens 100-399 allowed; every seventh token allowed."""
    step = StepBitmask(2, VOCAB)
    allowed = np.zeros((2, step.bitmask.shape[1] * 32), dtype=bool)
    allowed[0, 100:400] = True
    allowed[1, ::7] = True
    words = np.packbits(allowed, axis=1, bitorder="little").view("<i4")  # xgrammar's layout
    step.bitmask.copy_(torch.from_numpy(words.copy()))
    return step


def _sample(device: str, logits: torch.Tensor):
    sampler = Sampler(seed=3)
    rows = _rows(_mask_step() if HAS_XGRAMMAR else None)
    processed = sampler.process(logits.to(device, copy=True), rows)  # process() works in place
    out = sampler.sample_processed(processed, rows)
    probs = sampler.probs(processed, rows)
    return out, probs.cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_device_sampling_draws_what_the_host_draws(device):
    logits = torch.randn(len(PARAMS), VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    host, host_probs = _sample("cpu", logits)
    here, probs = _sample(device, logits)
    assert here.token_ids == host.token_ids
    assert torch.allclose(probs, host_probs, atol=1e-5)
    assert here.logprobs == pytest.approx(host.logprobs, abs=1e-4)
    assert here.top_ids == host.top_ids
    assert host.token_ids[0] not in (7, 8)  # blocked
    if HAS_XGRAMMAR:  # the grammar's rows held
        assert 100 <= host.token_ids[3] < 400 and host.token_ids[0] % 7 == 0
    assert host.token_ids[7] != 17
