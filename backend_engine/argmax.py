"""Greedy token choice: the argmax of each row of logits, as `torch.argmax` gives it.

ATen's CPU argmax walks a row one element at a time, while its max reduction (`amax`) is
vectorised: over a 49,152-token vocabulary argmax costs several times amax, and at 16 rows a
sizeable share of the lm_head's own time. So a row's maximum is found chunk by chunk with
amax, and argmax runs only inside the first chunk holding it. The result is torch.argmax's to
the index: the first maximal value wins, and a NaN counts as the maximum (amax propagates it,
and argmax over the chunk maxima then picks the first chunk with one).
"""

from __future__ import annotations

import torch

CHUNK = 1024  # vocabulary entries per amax chunk


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] -> int64 [rows], equal to logits.argmax(dim=-1)."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab < 4 * CHUNK or rows == 0:
        return logits.argmax(dim=-1)
    full = vocab // CHUNK
    maxima = logits[:, :full * CHUNK].reshape(rows, full, CHUNK).amax(dim=-1)
    if vocab % CHUNK:
        maxima = torch.cat([maxima, logits[:, full * CHUNK:].amax(dim=-1, keepdim=True)], dim=1)
    start = maxima.argmax(dim=-1) * CHUNK
    # the last chunk may be short: its missing places repeat the last entry, which comes after
    # the entry itself, so the first maximum is still the one argmax returns
    index = (start[:, None] + torch.arange(CHUNK)).clamp_(max=vocab - 1)
    return start + logits.gather(1, index).argmax(dim=-1)
