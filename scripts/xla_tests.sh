#!/usr/bin/env bash
# The Neuron backend's XLA tests (tests/xla) in their own venv: made (or reused) by
# scripts/xla_env.sh, then run on PyTorch/XLA's CPU device.
#   bash scripts/xla_tests.sh VENV
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:?usage: $0 VENV}"
bash scripts/xla_env.sh "$venv"
# A module at a time: the tests of a module share PyTorch/XLA's compile cache, and their
# compile counts assume its order.
PJRT_DEVICE=CPU "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile \
    --durations=8 tests/xla
