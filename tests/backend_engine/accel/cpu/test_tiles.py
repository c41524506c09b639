"""The `tiles` form of prompt rows (accel/cpu/tiles.py): torch's int4 layout read back, the
tiled GEMM giving a row the same bits wherever it sits, and the engine giving a prompt's last
row the same logits, to the bit, however the prompt was chunked or cached."""

import pytest
import torch

from backend_engine.attention.metadata import AttentionMetadata, PrefillChunk
from backend_engine.accel.cpu import kernels as cpu
from backend_engine.accel.cpu import tiles as cpu_gemm
from backend_engine.config import EngineConfig
from backend_engine.llm import LLM
from backend_engine.quant.formats import quantize_int4, quantize_int8
from backend_engine.sampling_params import SamplingParams
from backend_engine.step_batch import StepBatch


@pytest.mark.parametrize("n", [16, 48, 64, 112, 960])
def test_int4_layout_reads_back_what_torch_packed(n):
    q = torch.randint(0, 16, (n, 96), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(cpu_gemm.unpack_int4(packed).to(torch.int32), q)
    assert cpu_gemm.int4_layout_checked()


@pytest.mark.parametrize("shape", [(3072, 576), (576, 1536)])  # SmolLM2's gate_up and down
def test_a_rows_bits_do_not_depend_on_its_place_or_neighbours(shape):
    # one GEMM over 512 rows and one over a slice of them differ here (checked on this
    # project's CPUs at 2-32 rows for the first shape, 64-300 for the second)
    w = torch.randn(*shape).to(torch.bfloat16).t()  # as the int8 form passes it
    x = torch.randn(512, shape[1])
    whole = cpu_gemm.tiled_mm(x, w)
    for rows in (1, 2, 8, 16, 17, 32, 64, 100, 256, 300):
        assert torch.equal(cpu_gemm.tiled_mm(x[:rows], w), whole[:rows]), rows
    for offset in (7, 63, 150):
        assert torch.equal(cpu_gemm.tiled_mm(x[offset:offset + 100], w),
                           whole[offset:offset + 100]), offset
    others = torch.cat([torch.randn(5, shape[1]) * 100, x[:40]])
    assert torch.equal(cpu_gemm.tiled_mm(others, w)[5:], whole[:40])


@pytest.mark.parametrize("out_features,perm", [(200, False), (96, True)])
def test_prompt_forms_match_the_kernels_and_the_dequantised_weights(out_features, perm):
    w = torch.randn(out_features, 128)
    x = torch.randn(70, 128)
    w4 = quantize_int4(w, 32, "w")
    if perm:  # GPTQ act-order: groups over a permutation of the input channels
        w4.perm = torch.randperm(128)
    for q, form, kernel in ((cpu.prepare_int8(quantize_int8(w)), cpu_gemm.int8_tiles,
                             cpu.int8_mm), (cpu.prepare_int4(w4), cpu_gemm.int4_tiles,
                                            cpu.int4_mm)):
        y = form(x, q)
        assert y.shape == (70, out_features) and y.dtype == x.dtype
        ref = x @ q.dequantize().t()
        scale = ref.abs().max()
        assert (y - ref).abs().max() < 2e-2 * scale  # bf16 inputs and outputs
        assert (y - kernel(x, q)).abs().max() < 2e-2 * scale


def test_prompt_rows_split_from_the_other_rows():
    meta = AttentionMetadata(torch.arange(10), num_decode_tokens=2,
                             decode_block_tables=torch.zeros(2, 1, dtype=torch.long),
                             decode_context_lens=torch.tensor([4, 5]))
    table = torch.tensor([3, 4])
    meta.prefills = [PrefillChunk(2, 5, 20, table, 3), PrefillChunk(7, 3, 3, table, None)]
    prompt, other = meta.split_prompt_rows()
    assert prompt.rows.tolist() == [2, 3, 4, 7, 8, 9]
    assert [(c.query_start, c.query_len, c.context_len) for c in prompt.meta.prefills] == [
        (0, 3, 18), (3, 3, 3)]
    assert prompt.meta.num_decode_tokens == 0
    assert other.rows.tolist() == [0, 1, 5, 6]
    assert other.meta.num_decode_tokens == 2
    assert [(c.query_start, c.query_len, c.context_len) for c in other.meta.prefills] == [
        (2, 2, 20)]
    assert other.meta.slot_mapping.tolist() == [0, 1, 5, 6]


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(request):
    return LLM("tiny-random", enforce_eager=True, num_kv_blocks=64,
               quantization=request.param, engine_options={"prompt": "tiles"})


def _last_logits(llm, tokens: list[int], cuts: list[int]) -> torch.Tensor:
    """Run the prompt in steps ending at each cut, then to its end; the last row's logits."""
    runner = llm.engine.runner
    blocks = list(range(-(-len(tokens) // runner.block_size)))
    logits, start = None, 0
    for end in [*cuts, len(tokens)]:
        batch = StepBatch([tokens[start:end]], [start], [len(tokens)], [blocks], [len(tokens)])
        logits = runner.forward_batch(batch)[1]
        start = end
    return logits


def test_a_prompt_gives_the_same_logits_bits_however_it_is_chunked(quantized, monkeypatch):
    calls = []
    real = cpu_gemm.tiled_mm
    monkeypatch.setattr(cpu_gemm, "tiled_mm", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    tokens = list(range(40, 140))
    whole = _last_logits(quantized, tokens, [])
    assert calls and set(calls) == {99}  # every prompt row but the last took the GEMM tiles
    for cuts in ([37], [50, 51], [99], [16, 32, 48, 64, 80, 96]):
        # 99: the last token alone, as after a prefix-cache hit on all the others
        assert torch.equal(_last_logits(quantized, tokens, cuts), whole), cuts


def test_a_kernel_prompt_form_keeps_prompt_rows_on_the_kernel(monkeypatch):
    llm = LLM("tiny-random", enforce_eager=True, num_kv_blocks=64, quantization="int8",
              engine_options={"prompt": "kernel"})
    assert llm.engine.runner.forward_pass.prompt_linear is None  # one Linear for every row
    calls = []
    monkeypatch.setattr(cpu_gemm, "tiled_mm", lambda *a: calls.append(1))
    llm.generate("a b c d e f g", SamplingParams(temperature=0, max_tokens=4))
    assert not calls


def test_an_unknown_prompt_form_is_refused():
    with pytest.raises(ValueError, match="prompt"):
        EngineConfig(engine_options={"prompt": "fast"}).validate()


def test_a_resident_copy_gives_the_per_call_bits_and_goes_with_its_weight():
    w, x = torch.randn(200, 128), torch.randn(70, 128)
    for prepare, form in ((lambda: cpu.prepare_int8(quantize_int8(w)), cpu_gemm.int8_tiles),
                          (lambda: cpu.prepare_int4(quantize_int4(w, 32, "w")),
                           cpu_gemm.int4_tiles)):
        q = prepare()
        per_call = form(x, q)
        assert cpu_gemm.extra_bytes(q) == 0
        cpu_gemm.keep_resident([q, q])  # a weight listed twice is copied once
        assert cpu_gemm.extra_bytes(q) > 0
        calls = []
        key = cpu_gemm._tiled_key(q)
        n = key.shape[0]
        assert cpu_gemm.resident_bytes([q, q]) == n * 128 * cpu_gemm.GEMM_DTYPE.itemsize
        assert cpu_gemm.extra_bytes(q) == cpu_gemm.resident_bytes([q])
        # the copy is what the tiles read: no dequantisation in the call
        real = cpu_gemm._fused_dequantize
        cpu_gemm._fused_dequantize = lambda *a: calls.append(1) or real(*a)
        try:
            assert torch.equal(form(x, q), per_call)
        finally:
            cpu_gemm._fused_dequantize = real
        assert not calls
        del q
        assert cpu_gemm._resident.lookup(key) is None  # dropped with its weight


@pytest.mark.parametrize("option,budget,expected", [
    ({}, None, "resident"), ({"prompt_weights": "per_call"}, None, "per_call"),
    ({}, 0, "per_call"), ({"prompt_weights": "resident"}, 0, "resident")])
def test_prompt_weights_are_resident_where_they_fit_the_budget(option, budget, expected,
                                                               monkeypatch):
    if budget is not None:
        monkeypatch.setattr(cpu_gemm, "RESIDENT_BUDGET_BYTES", budget)
    llm = LLM("tiny-random", enforce_eager=True, num_kv_blocks=64, quantization="int4",
              engine_options={"prompt": "tiles", **option})
    forward = llm.engine.runner.forward_pass
    assert forward.plan.prompt_weights == expected
    assert f"tiles weights {expected.replace('_', ' ')}" in forward.describe()
    weights = llm.engine.runner.model.linear_weights()
    assert all(cpu_gemm.extra_bytes(w) > 0 for w in weights) == (expected == "resident")


def test_resident_and_per_call_prompt_weights_give_the_same_bits():
    tokens = list(range(40, 140))
    logits = [_last_logits(LLM("tiny-random", enforce_eager=True, num_kv_blocks=64,
                               quantization="int4",
                               engine_options={"prompt": "tiles", "prompt_weights": value}),
                           tokens, [37]) for value in ("per_call", "resident")]
    assert torch.equal(*logits)
