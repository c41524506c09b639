"""Speculative decoding: lossless (greedy identical, sampled distribution preserved), batched
with ordinary sequences, and leak-free with rejections and aborts."""

import collections

import pytest
import torch

from backend_engine.llm import LLM
from backend_engine.rejection_sampler import verify_greedy, verify_sampled
from backend_engine.sampling_params import SamplingParams
from backend_engine.spec_decode.ngram import NgramProposer
from tests.backend_engine.helpers import assert_no_leaks

TEXT = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of "
        "having nothing to do: once or twice she had peeped into the book her sister was reading.")
PROMPTS = [f"Repeat exactly: {TEXT}\nRepeated: {TEXT[:30]}",  # grounded: drafts get accepted
           "Tell me about the sea.",  # open-ended
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# chi-square critical values at significance 0.001, by degrees of freedom
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


def test_ngram_proposes_what_followed_the_latest_match():
    p = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3], 10) == [4, 5, 1]
    assert p.propose([9, 8, 7], 10) == []
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3], 2) == [4, 5]  # bounded by the room left
    assert p.propose([256, 1, 2, 256, 1], 10) == [2, 256, 1]  # byte-aligned matches only


def test_greedy_verification_accepts_until_first_mismatch():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 2]):
        logits[row, best] = 1.0
    assert verify_greedy(logits, [3, 5, 7]) == [3, 5, 7, 2]  # all accepted + bonus
    assert verify_greedy(logits, [3, 6, 7]) == [3, 5]  # correction at the first mismatch


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_sampling_preserves_the_target_distribution(with_draft_probs):
    g = torch.Generator().manual_seed(0)
    target = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]])
    draft_q = torch.tensor([[0.7, 0.1, 0.1, 0.1]])
    trials, counts = 20000, collections.Counter()
    for _ in range(trials):
        if with_draft_probs:
            x = int(torch.multinomial(draft_q[0], 1, generator=g))
            out = verify_sampled(target, [x], draft_q, g)
        else:
            out = verify_sampled(target, [0], None, g)  # a deterministic (n-gram) draft
        counts[out[0]] += 1
    chi2 = sum((counts[i] - trials * p) ** 2 / (trials * p) for i, p in enumerate(target[0]))
    assert chi2 < CHI2_CRIT[3], (chi2, counts)


def test_greedy_output_identical_with_ngram_speculation_in_mixed_batches(default_llm):
    reference = [o.outputs[0].token_ids for o in default_llm.generate(PROMPTS, GREEDY)]
    spec = LLM("default", enforce_eager=True, quantization="none", num_kv_blocks=256, speculative_method="ngram",
               num_speculative_tokens=4)
    outs = spec.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = spec.engine.spec.stats
    assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0
    assert_no_leaks(spec.engine)
    # one at a time as well (speculation on every step, nothing else in the batch)
    assert spec.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids == reference[0]


def _two_sample_chi2(a: collections.Counter, b: collections.Counter) -> tuple[float, int]:
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    na, nb = sum(a[k] for k in keys), sum(b[k] for k in keys)
    chi2 = 0.0
    for k in keys:
        total = a[k] + b[k]
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        chi2 += (a[k] - ea) ** 2 / ea + (b[k] - eb) ** 2 / eb
    return chi2, len(keys) - 1


def test_sampled_tokens_keep_their_distribution_under_speculation(tiny_llm):
    # A repetitive prompt so n-gram drafts exist; top_k=4 keeps the support small enough to
    # compare. Position 2 is the first token decided by verification.
    prompt = [11, 12, 13, 14] * 6
    params = [SamplingParams(temperature=1.0, top_k=4, max_tokens=3, seed=s, ignore_eos=True)
              for s in range(600)]
    spec = LLM("tiny-random", enforce_eager=True, num_kv_blocks=512, speculative_method="ngram",
               quantization=tiny_llm.engine.config.quantization,
               num_speculative_tokens=2, speculative_max_batch=1000, max_num_seqs=128)
    plain = [tuple(o.outputs[0].token_ids[:2]) for o in tiny_llm.generate([prompt] * 600, params)]
    specd = [tuple(o.outputs[0].token_ids[:2]) for o in spec.generate([prompt] * 600, params)]
    assert spec.engine.spec.stats.drafted_tokens > 0
    chi2, dof = _two_sample_chi2(collections.Counter(plain), collections.Counter(specd))
    assert dof >= 2 and chi2 < CHI2_CRIT.get(dof, 3 * dof), (chi2, dof)
    assert_no_leaks(spec.engine)


def test_rejections_and_aborts_leak_no_blocks(quantization):
    llm = LLM("tiny-random", enforce_eager=True, num_kv_blocks=96, speculative_method="ngram",
              num_speculative_tokens=5, block_size=16, speculative_max_batch=16,
              quantization=quantization)
    engine = llm.engine
    for seed in range(1, 9):  # sampled continuations of a random model rarely repeat a bigram
        params = SamplingParams(temperature=1.0, top_k=3, max_tokens=60, seed=seed,
                                ignore_eos=True)
        engine.add_request(f"keep{seed}", [5, 6, 7, 8] * 10, params)
    engine.add_request("drop", [9, 10, 11] * 12, params)
    for _ in range(6):
        engine.step()
    engine.abort_request("drop")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.spec.stats.drafted_tokens > engine.spec.stats.accepted_tokens  # rejections
    assert_no_leaks(engine)


def test_greedy_output_identical_with_a_draft_model(default_llm):
    prompts = PROMPTS[:2]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params)]
    # the target itself as draft (every draft accepted) and a tiny random draft (most rejected)
    for draft in ("default", "tiny-random"):
        spec = LLM("default", enforce_eager=True, quantization="none", num_kv_blocks=256, speculative_method="draft", draft_model=draft,
                   num_speculative_tokens=3)
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == reference
        stats = spec.engine.spec.stats
        assert stats.drafted_tokens > 0
        if draft == "default":
            assert stats.accepted_tokens == stats.drafted_tokens
        assert_no_leaks(spec.engine)
        assert spec.engine.proposer.pool.num_free_blocks == spec.engine.proposer.pool.num_blocks


def _perturbed_copy(model: str, folder, noise: float) -> str:
    """A draft that agrees with the target often but not always: its weights plus noise."""
    import shutil

    from safetensors.torch import load_file, save_file

    from backend_engine.model_loader import resolve_model

    source = resolve_model(model).folder
    shutil.copytree(source, folder)
    weights = load_file(str(source / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    save_file({k: v + noise * torch.randn(v.shape, generator=g) for k, v in weights.items()},
              str(folder / "model.safetensors"))
    return str(folder)


def test_sampled_tokens_keep_their_distribution_with_a_different_draft_model(tiny_llm, tmp_path):
    prompt = [21, 22, 23, 24, 25]
    draft = _perturbed_copy("tiny-random", tmp_path / "draft", noise=0.01)  # ~40 % accepted
    params = [SamplingParams(temperature=1.0, top_k=4, max_tokens=3, seed=s, ignore_eos=True)
              for s in range(600)]
    spec = LLM("tiny-random", enforce_eager=True, num_kv_blocks=1024, speculative_method="draft",
               quantization=tiny_llm.engine.config.quantization,
               draft_model=draft, num_speculative_tokens=2,
               speculative_max_batch=1000, max_num_seqs=128)
    # the second token is the first one decided by verifying a draft
    plain = [o.outputs[0].token_ids[1] for o in tiny_llm.generate([prompt] * 600, params)]
    specd = [o.outputs[0].token_ids[1] for o in spec.generate([prompt] * 600, params)]
    stats = spec.engine.spec.stats
    assert 0 < stats.accepted_tokens < stats.drafted_tokens  # both branches exercised
    chi2, dof = _two_sample_chi2(collections.Counter(plain), collections.Counter(specd))
    assert dof >= 2 and chi2 < CHI2_CRIT.get(dof, 3 * dof), (chi2, dof)
    assert_no_leaks(spec.engine)


def test_draft_model_with_another_vocabulary_is_refused(tmp_path):
    import json

    from backend_engine.errors import ModelLoadError
    from backend_engine.model_loader import resolve_model

    folder = resolve_model("tiny-random").folder
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 1000
    (other / "config.json").write_text(json.dumps(config))
    (other / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="vocabulary"):
        LLM("tiny-random", enforce_eager=True, speculative_method="draft", draft_model=str(other))


def test_controller_backs_off_failing_sequences_and_probes_again():
    from backend_engine.spec_decode.controller import SpecController

    c = SpecController(max_batch=4, min_acceptance=0.4, probe_every=4)
    assert c.should_speculate(4) and not c.should_speculate(5)  # large batches: off
    assert c.draft_budget("s", 4) >= 1
    c.record("s", 4, 0)  # a miss drops it below the bar
    budgets = [c.draft_budget("s", 4) for _ in range(8)]
    assert budgets == [0, 0, 0, 1, 0, 0, 0, 1]  # a one-token probe every 4 steps
    for _ in range(6):
        c.record("good", 4, 4)
    assert c.draft_budget("good", 4) == 4  # accepted drafts earn the full k
