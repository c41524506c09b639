"""The engine's side of structured outputs: requests wait here (outside the scheduler) until
their grammar is compiled; each sequence then gets its own matcher, drafts are cut to what the
grammar accepts, each step's bitmask is filled in the background, and sampled tokens advance
the matchers."""

from __future__ import annotations

import importlib.util
import logging
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

from backend_engine.errors import InvalidRequestError
from backend_engine.metrics import EngineStats
from backend_engine.sampler import SamplingRow
from backend_engine.sequence import Sequence
from backend_engine.structured.bitmask import MaskRow, StepBitmask
from backend_engine.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

    from backend_engine.structured.compiler import GrammarCompilerPool
    from backend_engine.structured.matcher import ReasoningWatch, SequenceGrammar

log = logging.getLogger("kvgate.engine")


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], stats: EngineStats):
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_token_ids = sorted(stop_token_ids)
        self.stats = stats
        self.compiler: GrammarCompilerPool | None = None
        if importlib.util.find_spec("xgrammar") is not None:
            from backend_engine.structured.compiler import GrammarCompilerPool

            self.compiler = GrammarCompilerPool(
                self._tokenizer_info, on_compiled=lambda s: stats.observe("grammar_compile", s))
        self._fill_executor = ThreadPoolExecutor(1, thread_name_prefix="kvgate-bitmask")
        self._pending: dict[str, tuple[Future, list[Sequence]]] = {}
        self._step: StepBitmask | None = None
        self._vocab_bytes: list[bytes] | None = None  # for reasoning watches, once needed

    def _tokenizer_info(self) -> xgr.TokenizerInfo:
        import xgrammar as xgr

        return xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self._stop_token_ids)

    def _watch(self, seq: Sequence, compiled: xgr.CompiledGrammar) -> ReasoningWatch | None:
        """What holds the grammar back while the output is reasoning (vLLM's rule)."""
        end = seq.params.reasoning_end
        if end is None:
            return None
        from backend_engine.structured.matcher import ReasoningWatch  # xgrammar: when used

        if self._vocab_bytes is None:
            self._vocab_bytes = compiled.tokenizer_info.decoded_vocab
        return ReasoningWatch(end, self._vocab_bytes)

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise InvalidRequestError if the constraint has no grammar (no compilation: fast), or
        if this replica cannot constrain output at all."""
        if self.compiler is None:
            raise InvalidRequestError(
                "structured outputs (response_format, structured_outputs, forced tool calls) need "
                "the 'xgrammar' package, which this replica does not have installed",
                param=params.param, code="unsupported")
        self.compiler.grammar(params)

    # -- requests waiting for their grammar -------------------------------------------------
    def add_request(self, request_id: str, params: StructuredOutputsParams,
                    seqs: list[Sequence]) -> None:
        self._pending[request_id] = (self.compiler.submit(params), seqs)

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    @property
    def num_pending_seqs(self) -> int:
        return sum(len(seqs) for _, seqs in self._pending.values())

    def take_ready(self) -> tuple[list[Sequence], list[str]]:
        """Sequences whose grammar is ready (matchers attached), and requests whose failed."""
        ready: list[Sequence] = []
        failed: list[str] = []
        for request_id, (future, seqs) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            from backend_engine.structured.matcher import SequenceGrammar

            if future.exception() is not None:
                log.error("grammar compilation failed for %s: %s", request_id, future.exception())
                failed.append(request_id)
                continue
            for seq in seqs:
                seq.grammar = SequenceGrammar(future.result(), self._watch(seq, future.result()))
                for token in seq.output_token_ids:  # a P/D decode side: first tokens came with it
                    seq.grammar.accept(token)
                ready.append(seq)
        return ready, failed

    def wait_for_pending(self, timeout_s: float) -> None:
        """Block briefly until a pending grammar is ready (the loop has nothing else to run)."""
        if self._pending:
            wait([f for f, _ in self._pending.values()], timeout_s, FIRST_COMPLETED)

    # -- speculative drafts -------------------------------------------------------------------
    @staticmethod
    def trim_drafts(seqs: list[Sequence]) -> None:
        """Keep only the drafts the grammar accepts: the rest could never be verified."""
        for seq in seqs:
            if seq.grammar is None or not seq.spec_token_ids:
                continue
            n = seq.grammar.valid_prefix(seq.spec_token_ids)
            if n < len(seq.spec_token_ids):
                seq.spec_token_ids = seq.spec_token_ids[:n]
                if seq.spec_draft_probs is not None:
                    seq.spec_draft_probs = seq.spec_draft_probs[:n] if n else None

    # -- the step's bitmask -----------------------------------------------------------------
    def start_step(self, scheduled: list[tuple[Sequence, int]],
                   rows: dict[Sequence, list[SamplingRow]]) -> None:
        """Give each row of a constrained sequence that samples this step its bitmask row, and
        start filling the bitmask (the sampler waits for it after the forward pass)."""
        work: list[tuple[SequenceGrammar, int, list[int]]] = []
        refs: list[tuple[SamplingRow, int]] = []
        for seq, n in scheduled:
            if seq.grammar is None or seq.num_computed_tokens + n < seq.num_tokens:
                continue  # free, or a prefill chunk that does not reach the end yet
            seq_rows = rows[seq]
            first = len(refs)
            work.append((seq.grammar, first, seq.spec_token_ids[:len(seq_rows) - 1]))
            refs.extend((r, first + j) for j, r in enumerate(seq_rows))
        if not work:
            return
        step = StepBitmask(len(refs), self.vocab_size)
        for row, index in refs:
            row.grammar_mask = MaskRow(step, index)
        step.start(self._fill_executor, work, lambda s: self.stats.observe("grammar_mask", s))
        self._step = step

    def finish_step(self) -> None:
        """The bitmask job is over before matchers advance (it reads them)."""
        if self._step is not None:
            self._step.wait()
            self._step = None

    @staticmethod
    def accept(seq: Sequence, token_id: int) -> bool:
        """Advance the sequence's matcher; True when its output must end here (the grammar is
        complete, or — never expected — the token broke it)."""
        grammar = seq.grammar
        if grammar is None:
            return False
        if not grammar.accept(token_id):
            log.error("sampled token %d is outside %s's grammar; ending it", token_id,
                      seq.seq_id)
            return True
        return grammar.is_terminated

    def shutdown(self) -> None:
        if self.compiler is not None:
            self.compiler.shutdown()
        self._fill_executor.shutdown(wait=False, cancel_futures=True)
