"""Per-request output state: detokenisation, stop conditions, logprobs, and the
RequestOutput objects (cumulative plus the delta since the last one) the engine hands out."""

from __future__ import annotations

from dataclasses import dataclass

import time

from backend_engine.detokenizer import IncrementalDetokenizer, TokenTexts
from backend_engine.kv_transfer.params import RemotePrefill
from backend_engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from backend_engine.sampling_params import SamplingParams
from backend_engine.sequence import Sequence

StopReason = tuple[str, str | int | None]  # (finish_reason, stop_reason)


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    outputs: list[CompletionOutput]
    arrival_time: float
    prompt: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.token_texts = TokenTexts(tokenizer)

    def new_state(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  seqs: list[Sequence], arrival: float, prompt: str | None) -> RequestState:
        detoks = [IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                         params.include_stop_str_in_output,
                                         params.skip_special_tokens) for _ in seqs]
        outputs = [CompletionOutput(i, logprobs=[] if params.logprobs is not None else None)
                   for i in range(len(seqs))]
        return RequestState(request_id, list(prompt_token_ids), params, seqs, detoks, outputs,
                            arrival, prompt)

    def blocked_tokens(self, seq: Sequence, num_new_outputs: int = 0) -> list[int]:
        """Tokens that may not be sampled yet (EOS and stop ids before min_tokens)."""
        if seq.num_output_tokens + num_new_outputs < seq.params.min_tokens:
            return list(self.eos_token_ids | set(seq.params.stop_token_ids))
        return []

    def append_token(self, state: RequestState, seq: Sequence, token: int,
                     logprob: tuple[float, list[int], list[float]] | None) -> StopReason | None:
        """Append one token to a sequence; returns why it must stop, if it must."""
        seq.append_token(token)
        out = state.outputs[seq.index]
        if out.logprobs is not None and logprob is not None:
            value, top_ids, top_values = logprob
            k = seq.params.logprobs or 0
            top = [(t, self.token_texts(t), v) for t, v in zip(top_ids[:k], top_values[:k])]
            out.logprobs.append(TokenLogprob(token, self.token_texts(token), value, top))
        return self._stop_reason(state, seq, token)

    def resume(self, state: RequestState, remote: RemotePrefill) -> list[tuple[Sequence, StopReason]]:
        """Append the first tokens a prefill replica sampled (one per sample) as outputs; the
        samples they already end, with why."""
        now, ended = time.monotonic(), []
        for seq, first in zip(state.seqs, remote.first_tokens):
            seq.first_token_time = now
            seq.num_cached_tokens = remote.cached_tokens  # what the prefill replica did not compute
            logprob = None if first.logprob is None else (
                first.logprob, [t for t, _ in first.top], [v for _, v in first.top])
            reason = self.append_token(state, seq, first.token_id, logprob)
            if reason is not None:
                ended.append((seq, reason))
        return ended

    def replay(self, state: RequestState, token_ids: list[int]) -> list[tuple[Sequence, StopReason]]:
        """Append output tokens another replica generated (and streamed) as if sampled here:
        the detokenizer, stop strings and length limit see them, and the text the other replica
        had already handed out is marked as handed out, so the stream goes on where it broke."""
        ended = []
        for seq in state.seqs:
            for token in token_ids:
                reason = self.append_token(state, seq, token, None)
                if reason is not None:
                    ended.append((seq, reason))
                    break
            out, detok = state.outputs[seq.index], state.detoks[seq.index]
            out.token_ids = list(seq.output_token_ids)
            detok.take_delta(False)  # what the other replica had streamed of this text
            out.text = detok.text[:detok.emitted]
        return ended

    def _stop_reason(self, state: RequestState, seq: Sequence, token: int) -> StopReason | None:
        p = seq.params
        past_min = seq.num_output_tokens >= p.min_tokens
        is_eos = token in self.eos_token_ids and not p.ignore_eos
        is_stop_id = token in p.stop_token_ids
        stop_str = None
        if not (is_eos or is_stop_id):
            stop_str = state.detoks[seq.index].add_token(token, check_stop=past_min)
        if past_min and is_stop_id:
            return ("stop", token)
        if past_min and is_eos:
            return ("stop", None)
        if stop_str is not None:
            return ("stop", stop_str)
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return ("length", None)
        return None

    def make_output(self, state: RequestState, finished: bool) -> RequestOutput:
        for seq, detok, out in zip(state.seqs, state.detoks, state.outputs):
            done = seq.is_finished
            out.delta_text = detok.take_delta(done)
            out.text = detok.text[:detok.emitted]
            new_ids = seq.output_token_ids[len(out.token_ids):]
            out.delta_token_ids = new_ids
            out.token_ids = out.token_ids + new_ids
            if out.logprobs is not None:
                out.delta_logprobs = out.logprobs[len(out.logprobs) - len(new_ids):]
            out.finish_reason = seq.finish_reason if done else None
            out.stop_reason = seq.stop_reason if done else None
        first = state.seqs[0]
        metrics = {"arrival_time": state.arrival_time}
        if first.first_token_time is not None:
            metrics["first_token_time"] = first.first_token_time
        return RequestOutput(
            state.request_id, state.prompt_token_ids,
            [CompletionOutput(o.index, o.text, list(o.token_ids),
                              None if o.logprobs is None else list(o.logprobs), o.finish_reason,
                              o.stop_reason, o.delta_text, o.delta_token_ids, o.delta_logprobs)
             for o in state.outputs],
            num_cached_tokens=max(0, first.num_cached_tokens), finished=finished,
            prompt=state.prompt, metrics=metrics)
