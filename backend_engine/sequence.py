"""A sequence: one sample of a request, the unit the scheduler and block manager work on."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backend_engine.kv_block import KVBlock
from backend_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from backend_engine.structured.matcher import SequenceGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: str
    request_id: str
    index: int  # choice index within the request (n > 1)
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: str
    max_tokens: int  # effective: bounded by the context and the KV pool
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache (-1: not yet known)
    block_table: list[KVBlock] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # block_table's ids, kept in step with it
    # KV cache groups past the first (kv_cache_groups.py), each table and its ids; block_table
    # and block_ids are group 0's
    group_block_tables: list[list[KVBlock]] = field(default_factory=list)
    group_block_ids: list[list[int]] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks of block_table known to carry their hash
    block_hashes: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # drafted, not yet verified
    spec_draft_probs: Any = None  # [len(spec), V] draft-model probabilities (None: n-gram)
    parent: Sequence | None = None  # the sibling whose prompt blocks this one forks
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    progress_time: float | None = None  # the end of the last step that computed its tokens
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: Any = None  # torch.Generator when the request has a seed (runner-owned)
    priority: int = 0  # lower is served earlier (vLLM's convention)
    grammar: SequenceGrammar | None = None  # structured outputs: this sample's matcher

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
