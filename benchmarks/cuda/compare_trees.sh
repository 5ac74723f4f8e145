#!/usr/bin/env bash
# The CUDA backend's engine numbers of two source trees in one lease, one process each, so
# that a change that should not move them can be shown not to: the Llama-3-8B shape (batch-1
# decode, 256 x (512+128), one 8K prefill) and the Qwen3-30B-A3B MoE shape (batch-1 decode).
#   bash benchmarks/cuda/compare_trees.sh BEFORE_TREE [engine] [moe]
# BEFORE_TREE is an export of the other commit (git archive COMMIT | tar -x -C DIR). Each
# tree's benchmark imports that tree's deepinfer. Results: $OUT (default
# benchmarks/results/cuda/compare) / {before,after}/*.json; then compare_trees.py.
set -uo pipefail
cd "$(dirname "$0")/../.."
before="$(cd "$1" && pwd)"; shift
parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(engine moe)
out="${OUT:-benchmarks/results/cuda/compare}"
mkdir -p "$out/before" "$out/after"
out="$(cd "$out" && pwd)"
export PYTHONUNBUFFERED=1 DEEPINFER_CACHE_DIR="${DEEPINFER_CACHE_DIR:-/tmp/deepinfer-cache}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for part in "${parts[@]}"; do
  for side in before after; do
    tree=$PWD; [ $side = before ] && tree=$before
    echo "=== $part $side ($tree)"
    t0=$SECONDS
    case $part in
      engine) python3 "$tree/benchmarks/cuda/engine_bench.py" --skip-hf --out "$out/$side" ;;
      moe) python3 "$tree/benchmarks/cuda/moe_engine_bench.py" --skip-hf --quick \
             --out "$out/$side" ;;
    esac 2>&1 | grep -v "^\s*$" | tail -n 12
    echo "=== $part $side took $((SECONDS - t0)) s"
  done
done
