"""Llama-family decoder (Llama, SmolLM, Qwen2, Mistral) over paged KV caches.

Weights come from a Hugging Face state dict; q/k/v and gate/up are fused into one matmul each.
Under tensor parallelism the state dict is this rank's shard (distributed/sharding.py): the
model then holds its share of the heads and of the MLP, sums the o and down projections over
the ranks, and looks up / scores the vocabulary in parallel (distributed/vocab.py).
A linear weight may arrive quantised (GGUF/AWQ/GPTQ) or be quantised here (`quantization`
int8/int4); either way it goes through `RowAwareLinear`, so the layer code has no format branch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from backend_engine.attention.backend import AttentionBackend
from backend_engine.attention.metadata import AttentionMetadata
from backend_engine.distributed.group import SINGLE, TensorParallelGroup
from backend_engine.distributed.sharding import shard_layout
from backend_engine.distributed.vocab import embed_tokens, gather_logits
from backend_engine.errors import ModelLoadError
from backend_engine.models.compiled_layers import CompiledLayers, compiled_layers
from backend_engine.models.decode_graph import DecodeGraph, use_cpp_wrapper, use_frozen
from backend_engine.models.layer_halves import input_half, output_half, prompt_linear, rms_norm
from backend_engine.models.linear import RowAwareLinear, choose_prompt_form
from backend_engine.models.rotary import RotaryEmbedding
from backend_engine.quant.formats import cat_rows, is_quantized
from backend_engine.quant.prepare import prepare, prepare_lm_head, prompt_form, quantize


class DecoderLayer:
    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, model: "LlamaModel"):
        def w(name: str) -> torch.Tensor:
            key = prefix + name
            if key not in weights:
                raise ModelLoadError(f"weight {key} missing from the checkpoint")
            return weights[key]

        def fused(*names: str):
            return model.prepare_linear(cat_rows([w(n) for n in names]), prefix + names[0])

        attn = "self_attn."
        self.qkv_weight = fused(attn + "q_proj.weight", attn + "k_proj.weight",
                                attn + "v_proj.weight")
        bias_keys = [prefix + attn + f"{p}_proj.bias" for p in "qkv"]
        self.qkv_bias = (model.to_compute(torch.cat([weights[k] for k in bias_keys]))
                         if all(k in weights for k in bias_keys) else None)
        self.o_weight = fused(attn + "o_proj.weight")
        self.gate_up_weight = fused("mlp.gate_proj.weight", "mlp.up_proj.weight")
        self.down_weight = fused("mlp.down_proj.weight")
        self.input_norm = model.to_compute(w("input_layernorm.weight"))
        self.post_attn_norm = model.to_compute(w("post_attention_layernorm.weight"))
        self.model = model

    def __call__(self, hidden, positions, k_cache, v_cache, meta: AttentionMetadata,
                 cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
                 linear: Callable | None = None):
        m = self.model
        linear = linear or m.linear
        q, k, v = input_half(hidden, self.input_norm, self.qkv_weight, self.qkv_bias,
                             *(cos_sin or m.rotary.cos_sin(positions)), m.eps, m.num_heads,
                             m.num_kv_heads, m.head_dim, linear)
        m.attention.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        attn = m.attention.forward(q, k_cache, v_cache, meta, m.scale)
        return output_half(attn, hidden, self.o_weight, self.post_attn_norm,
                           self.gate_up_weight, self.down_weight, m.eps, linear,
                           m.tp.all_reduce)


class LlamaModel:
    def __init__(self, config, weights: dict[str, torch.Tensor], attention: AttentionBackend,
                 max_positions: int, dtype: torch.dtype, device: str = "cpu",
                 calibrate_matmuls: bool = True, tp: TensorParallelGroup = SINGLE,
                 quantization: str | None = None, quant_group_size: int = 32,
                 lm_head_quantization: str = "w8a8", quantized_prefill: str = "auto",
                 compile_templates: bool = True, quantized_decode: str = "auto"):
        """Under tensor parallelism (`tp` of more than one rank), `weights` is the rank's shard.
        quantized_prefill: how prompt tokens multiply quantised weights on CPU ("dequant",
        "template", "int8", "kernel", or "auto": the fastest measured, the template only where
        `compile_templates`; `prompt_matmul` says which). quantized_decode: whether the compiled
        decode step freezes quantised weights into Inductor's GEMM templates ("template",
        "kernel", or "auto": int8 on AMX CPUs; decode_graph.use_frozen) or multiplies int8
        weights in integers ("int8": `int8_sums`)."""
        self.config = config
        self.tp = tp
        self.layout = shard_layout(config, tp.rank, tp.size)
        self.num_heads = self.layout.num_heads  # this rank's (all of them without parallelism)
        self.num_kv_heads = self.layout.num_kv_heads
        self.head_dim = self.layout.head_dim
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads")
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        self.num_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        self.attention = attention
        self.rotary = RotaryEmbedding(config, self.head_dim, max_positions, dtype, device)
        self.dtype, self.device = dtype, torch.device(device)
        self.quantization, self.quant_group_size = quantization, quant_group_size
        self.quantized_decode = quantized_decode if compile_templates else "kernel"
        # int8 weights multiplying every row in integers (quant/cpu_int8_gemm.py), when asked:
        # faster at uniform batches, slower than the kernel under a trace's mixed contexts
        self.int8_sums = self.device.type == "cpu" and quantized_decode == "int8"
        self.embed = self.to_compute(weights["model.embed_tokens.weight"])
        self.norm = self.to_compute(weights["model.norm.weight"])
        tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in weights
        lm_head = weights["model.embed_tokens.weight"] if tied else weights["lm_head.weight"]
        if quantization or is_quantized(lm_head):
            # the largest single matrix (49152 x 576 in SmolLM2), read whole at every step:
            # int8 per channel (times int8 activations by default), or int4 where asked
            self.lm_head = prepare_lm_head(lm_head, lm_head_quantization, quant_group_size,
                                           self.device, dtype)
        else:
            self.lm_head = self.embed if tied else self.to_compute(lm_head)
        self.layers = [DecoderLayer(weights, f"model.layers.{i}.", self)
                       for i in range(self.num_layers)]
        self.linear = RowAwareLinear()
        self.compiled: CompiledLayers | None = None  # use_compiled_layers()
        self.compiled_prompt: CompiledLayers | None = None  # the same with prompt forms
        self.decode_graph: DecodeGraph | None = None  # use_compiled_layers(kv_caches)
        if calibrate_matmuls and self.device.type == "cpu":
            self.linear.calibrate([*self._weight_groups(), [self.lm_head]], dtype=dtype)
        # prompt rows through dequantise-then-GEMM (quant/cpu_gemm.py), int4's GEMM template
        # (quant/cpu_template.py) or integer sums (quant/cpu_int8_gemm.py); one rank only,
        # since ranks deciding apart would run different passes around their all-reduces
        self.prompt_matmul = "kernel"  # "kernel", "gemm", "template" or "int8"
        if (quantized_prefill != "kernel" and self.device.type == "cpu" and tp.size == 1
                and self._has_prompt_forms()):
            self.prompt_matmul = choose_prompt_form(self._weight_groups(), quantized_prefill,
                                                    dtype, compile_templates)
        self.prompt_gemm = self.prompt_matmul != "kernel"
        # the template hides behind the gemm form (int4_prompt_mm finds it on the weight)
        self.prompt_linear = prompt_linear("int8" if self.prompt_matmul == "int8" else "gemm")

    def _weight_groups(self) -> list[list]:
        """Each layer's weights by role: qkv, o, gate_up, down."""
        layers = self.layers
        return [[layer.qkv_weight for layer in layers], [layer.o_weight for layer in layers],
                [layer.gate_up_weight for layer in layers],
                [layer.down_weight for layer in layers]]

    def _has_prompt_forms(self) -> bool:
        return all(not isinstance(w, torch.Tensor) and prompt_form(w.kind) is not None
                   for group in self._weight_groups() for w in group)

    def to_compute(self, t: torch.Tensor) -> torch.Tensor:
        """Embeddings, norms and biases: the compute dtype on the model's device."""
        return t.to(dtype=self.dtype, device=self.device).contiguous()

    def prepare_linear(self, w, name: str):
        """Quantise at load when asked (int8/int4), then lay out for the device's kernels."""
        return prepare(quantize(w, self.quantization, self.quant_group_size, name), self.device,
                       self.dtype, self.int8_sums)

    def use_compiled_layers(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None
                            = None) -> bool:
        """Run the layers' row-wise ops compiled (compiled_layers.py; one rank; the matmuls as
        `traced_linear` runs them: F.linear, or a quantised weight's one CPU kernel) and, given
        the engine's KV caches and torch attention, decode rows as one graph (decode_graph.py).
        Compiles now, for one row and for several; False, and eager layers, if it cannot."""
        layer = self.layers[0]
        weights = (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)
        key = (self.dtype, self.eps, self.num_heads, self.num_kv_heads, self.head_dim,
               layer.qkv_bias is not None,
               *((type(w), tuple(w.shape), getattr(w, "group_size", None)) for w in weights))
        compiled = compiled_layers(key)
        prompt = compiled_layers(key, self.prompt_linear) if self.prompt_gemm else None
        hidden_size = self.embed.shape[1]
        with torch.inference_mode():  # inference tensors, as in the engine's steps
            for rows in (1, 3):
                hidden = torch.zeros(rows, hidden_size, dtype=self.dtype, device=self.device)
                attn = torch.zeros(rows, self.num_heads, self.head_dim, dtype=self.dtype,
                                   device=self.device)
                cos, sin = self.rotary.cos_sin(torch.zeros(rows, dtype=torch.long,
                                                           device=self.device))
                for entry in filter(None, (compiled, prompt)):
                    self._run_compiled(entry, hidden, cos, sin, attn)
        if compiled.failed:
            return False
        self.compiled = compiled
        # prompt passes run eager if their forms do not compile here (each role keeps its code)
        self.compiled_prompt = prompt if prompt is not None and not prompt.failed else None
        if kv_caches is not None and self.attention.name == "torch":
            layers = tuple((layer.input_norm, layer.qkv_weight, layer.qkv_bias, layer.o_weight,
                            layer.post_attn_norm, layer.gate_up_weight, layer.down_weight)
                           for layer in self.layers)
            shape = (self.norm, self.eps, self.num_heads, self.num_kv_heads, self.head_dim,
                     self.scale)
            first = use_frozen(self.quantized_decode, layers)
            # each form falls back to the next if it does not compile here
            forms = [(first, use_cpp_wrapper(self.device, first)),
                     (False, use_cpp_wrapper(self.device, False)), (False, False)]
            for frozen, cpp_wrapper in dict.fromkeys(forms):
                graph = DecodeGraph(layers, *shape, frozen=frozen, cpp_wrapper=cpp_wrapper)
                if graph.warm_up(kv_caches, hidden_size, self.rotary.cos_sin):
                    self.decode_graph = graph
                    break
        return True

    def _run_compiled(self, compiled: CompiledLayers, hidden, cos, sin, attn=None, kv_caches=(),
                      meta: AttentionMetadata | None = None) -> torch.Tensor:
        """The layers with compiled row-wise halves; attention (and K/V stores) in between,
        eager; `attn` given instead of caches: the warm-up, which touches no cache."""
        shape = (self.eps, self.num_heads, self.num_kv_heads, self.head_dim)
        first = self.layers[0]
        q, k, v = compiled.run("first", (hidden, first.input_norm, first.qkv_weight,
                                         first.qkv_bias, cos, sin, *shape), (0, 4, 5))
        caches = kv_caches or [None] * self.num_layers
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            if cache is not None:
                self.attention.store_kv(k, v, *cache, meta.slot_mapping)
                # contiguous, as at warm-up (strides are guarded: another layout recompiles)
                attn = self.attention.forward(q, *cache, meta, self.scale).contiguous()
            out = (attn, hidden, layer.o_weight, layer.post_attn_norm, layer.gate_up_weight,
                   layer.down_weight)
            if i + 1 == self.num_layers:
                return compiled.run("last", (*out, self.norm, self.eps), (0, 1))
            nxt = self.layers[i + 1]
            hidden, q, k, v = compiled.run("between", (*out, nxt.input_norm, nxt.qkv_weight,
                                                       nxt.qkv_bias, cos, sin, *shape),
                                           (0, 1, 9, 10))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = embed_tokens(input_ids, self.embed, self.layout, self.tp)
        cos, sin = self.rotary.cos_sin(positions)
        nd = meta.num_decode_tokens
        if self.decode_graph is not None and nd:
            out = self.decode_graph(hidden[:nd], cos[:nd], sin[:nd], kv_caches,
                                    meta.slot_mapping[:nd], meta.decode_block_tables,
                                    meta.decode_context_lens)
            if out is not None:
                if not meta.prefills:
                    return out
                rest = self._by_role(hidden[nd:], cos[nd:], sin[nd:], positions[nd:],
                                     kv_caches, meta.prefill_part())
                return torch.cat([out, rest])
        return self._by_role(hidden, cos, sin, positions, kv_caches, meta)

    def _by_role(self, hidden, cos, sin, positions, kv_caches, meta: AttentionMetadata):
        """The layers over these rows; with `prompt_gemm`, the rows of prompt tokens (but each
        prompt's last) in one pass with the prompt forms, then the others (last prompt tokens,
        generated tokens recomputed, drafts, decode rows) with the kernels: which form a row
        takes depends on its token's place in its sequence alone."""
        if not self.prompt_gemm:
            return self._layers(hidden, (cos, sin), positions, kv_caches, meta)
        prompt, other = meta.split_prompt_rows()
        if not len(other.rows):
            return self._layers(hidden, (cos, sin), positions, kv_caches, meta, prompt=True)
        if not len(prompt.rows):
            return self._layers(hidden, (cos, sin), positions, kv_caches, meta)
        out = torch.empty_like(hidden)
        for part, is_prompt in ((prompt, True), (other, False)):  # prompt K/V first
            rows = part.rows.to(hidden.device)
            out[rows] = self._layers(hidden[rows], (cos[rows], sin[rows]), positions[rows],
                                     kv_caches, part.meta, prompt=is_prompt)
        return out

    def _layers(self, hidden, cos_sin, positions, kv_caches, meta: AttentionMetadata,
                prompt: bool = False):
        """The layers one by one (compiled halves or eager), then the final norm; `prompt`:
        with the prompt forms."""
        compiled = self.compiled_prompt if prompt else self.compiled
        if compiled is not None:
            return self._run_compiled(compiled, hidden, *cos_sin, kv_caches=kv_caches,
                                      meta=meta)
        linear = self.prompt_linear if prompt else None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            hidden = layer(hidden, positions, k_cache, v_cache, meta, cos_sin, linear)
        return rms_norm(hidden, self.norm, self.eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary; None on tensor-parallel ranks other than 0."""
        return gather_logits(self.linear(hidden, self.lm_head).float(), self.layout, self.tp)
