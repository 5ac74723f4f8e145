#!/usr/bin/env bash
# Install DeepInfer (with the structured-output extra) and start the OpenAI-compatible server;
# arguments go to deepinfer-serve. A torch that is already installed (a CUDA or Neuron build)
# is kept; where there is none, torch is pinned so that pip takes the CPU wheel where one is on
# hand instead of a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch" 2>/dev/null; then
    python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
python3 -m pip install -q --disable-pip-version-check -e ".[structured]"
exec deepinfer-serve "$@"
