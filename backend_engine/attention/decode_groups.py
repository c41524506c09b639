"""Grouping a step's decode rows for the torch attention path.

Padding every decode row to the step's longest context makes a step's attention cost grow with
batch x longest context instead of the sum of contexts (64 rows, one of 2,000 tokens and the
rest of 500: 2.6x the work). Rows are sorted by context length and cut into groups whose padding
stays under `MAX_PADDING`, and whose gathered K/V stay under `MAX_GROUP_BYTES`, so that the copy
a group's gather makes is still in cache when its two matmuls read it. Built once per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_PADDING = 0.25  # share of a group's gathered tokens that may be padding
MAX_GROUP_BYTES = 3 << 20  # K + V gathered for one group (stays in cache)


@dataclass(slots=True)
class DecodeGroup:
    rows: torch.Tensor | None  # the group's rows among the step's decodes; None: all, in order
    block_tables: torch.Tensor  # [rows, blocks] block ids (padding repeats a real block)
    bias: torch.Tensor | None  # [rows, 1, blocks * block_size]: 0, or -inf past the context
    context_lens: torch.Tensor  # [rows] tokens of context


def decode_groups(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                  bytes_per_token: int, device: torch.device, dtype: torch.dtype,
                  max_padding: float = MAX_PADDING,
                  max_group_bytes: int = MAX_GROUP_BYTES) -> list[DecodeGroup]:
    """Groups covering every decode row once. bytes_per_token: K + V of one token, one layer."""
    lens = context_lens.tolist()
    order = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)
    max_tokens = max(block_size, max_group_bytes // max(1, bytes_per_token))
    groups: list[list[int]] = []
    for i in order:
        if groups:
            group = groups[-1]
            longest = -(-lens[group[0]] // block_size) * block_size
            short_enough = lens[i] >= (1 - max_padding) * longest
            if short_enough and (len(group) + 1) * longest <= max_tokens:
                group.append(i)
                continue
        groups.append([i])
    whole = len(groups) == 1 and order == list(range(len(lens)))
    return [_group(g, lens, block_tables, block_size, device, dtype, whole) for g in groups]


def _group(rows: list[int], lens: list[int], block_tables: torch.Tensor, block_size: int,
           device: torch.device, dtype: torch.dtype, whole: bool) -> DecodeGroup:
    num_blocks = -(-lens[rows[0]] // block_size)
    index = torch.tensor(rows, dtype=torch.long)
    tables = block_tables.index_select(0, index.to(block_tables.device))[:, :num_blocks]
    group_lens = torch.tensor([lens[r] for r in rows])
    bias = None
    if int(group_lens.min()) < num_blocks * block_size:
        positions = torch.arange(num_blocks * block_size)
        past = positions.unsqueeze(0) >= group_lens.unsqueeze(1)
        bias = torch.zeros(past.shape, dtype=dtype).masked_fill_(past, float("-inf"))
        bias = bias[:, None, :].to(device)
    return DecodeGroup(None if whole else index.to(device), tables.contiguous(), bias,
                       group_lens.to(device))
