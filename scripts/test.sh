#!/usr/bin/env bash
# Install DeepInfer with its test extras and the example backend plugin, then run the tests.
# --quick runs all but the tests marked slow (see tests/conftest.py): a few minutes, not twenty.
# Both first run ruff and mypy (configured in pyproject.toml).
# The full run also runs the Neuron backend's XLA tests (tests/xla) in a venv of their own
# (scripts/xla_tests.sh; the venv at XLA_VENV, default .venv-xla, kept and reused): beside the
# main suite, niced, so they take the cores only while the main suite leaves them idle (its
# tests wait on spawned servers and rank processes much of the time).
# A torch that is already installed (a CUDA or Neuron build) is kept; where there is none, torch
# is pinned so that pip takes the CPU wheel where one is on hand instead of a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
select=()
case "${1:-}" in
    --quick) select=(-m "not slow") ;;
    "") ;;
    *) echo "usage: $0 [--quick]" >&2; exit 2 ;;
esac
# The installs below compile no bytecode up front; each module is compiled once, by the first
# process that imports it, and cached. An environment that forbids writing the cache
# (PYTHONDONTWRITEBYTECODE, set on some CI images) would make every process the tests spawn (a
# server, each of its ranks) compile torch and transformers from source again: seconds of CPU
# each, minutes over the suite.
unset PYTHONDONTWRITEBYTECODE
xla_venv="${XLA_VENV:-$PWD/.venv-xla}"
xla_log="$(mktemp)"
uv_cache="$(mktemp -d)"
xla_tests=""
# A failing main suite ends the XLA run too (its own session: the whole group).
trap '[ -n "$xla_tests" ] && kill -- -"$xla_tests" 2>/dev/null; rm -rf "$xla_log" "$uv_cache"' EXIT
pip=(python3 -m pip install -q --disable-pip-version-check --no-compile)
if ! python3 -c "import torch" 2>/dev/null; then
    "${pip[@]}" "torch==2.13.0"
fi
# Inside a virtual environment (what .ci/run makes) uv installs the test extras in seconds
# where pip takes over a minute (it resolves, downloads and unpacks in parallel); the torch
# above is kept. Its cache is this run's own. Outside one, pip. Neither compiles bytecode up
# front: Python compiles what the tests import when they import it.
if python3 -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    "${pip[@]}" uv
    UV_CACHE_DIR="$uv_cache" python3 -m uv pip install -q --python "$(command -v python3)" \
        -e ".[test]" ./examples/plugin
else
    "${pip[@]}" -e ".[test]" ./examples/plugin
fi
# The CPU backend's C++ kernels are built once here, not inside
# whichever test first starts an engine.
python3 -c "from deepinfer.backends.cpu.kernels import extension; extension()"
# Lint (import order included) and the type check of the core and the torch seam: seconds,
# and they fail before the tests' minutes start.
python3 -m ruff check deepinfer tests benchmarks scripts examples
python3 -m mypy
echo "=== installed, kernels built, linted: ${SECONDS} s"
# The XLA run starts here, not before the installs: niced, its 7 GB of downloads and unpacking
# wait for the cores the main suite leaves idle instead of slowing the kernel build.
if [ ${#select[@]} -eq 0 ]; then
    # setsid gives the run a session of its own, and with it (where the kernel groups
    # sessions for the scheduler, sched_autogroup) a scheduling group of its own that would
    # take half the CPU whatever its processes' nice: the group itself is niced too.
    setsid bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null
        exec nice -n 19 ionice -c 3 bash scripts/xla_tests.sh "$0"' "$xla_venv" \
        >"$xla_log" 2>&1 &
    xla_tests=$!
fi
# Two workers, a test file each at a time: most of the suite waits on spawned servers and rank
# processes or runs Triton's single-threaded interpreter, so the two cores overlap them.
python3 -m pytest -q -n 2 --dist loadfile --durations=25 ${select[@]+"${select[@]}"} tests
[ -z "$xla_tests" ] && exit 0
echo "=== main suite done: ${SECONDS} s; tests/xla (the XLA venv, scripts/xla_tests.sh)"
status=0
wait "$xla_tests" || status=$?
xla_tests=""
grep -v "^WARNING: Location" "$xla_log"
exit "$status"
