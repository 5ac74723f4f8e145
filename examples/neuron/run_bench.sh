#!/usr/bin/env bash
# The TTFT/TPOT matrix of bench_neuron.py through the server: starts deepinfer-serve, waits for
# /health, drives /v1/completions with aiperf when it is installed (else with serve_bench.py's
# OpenAI-client load generator), writes the JSON + PNG, and always stops the server it started.
#
#   bash examples/neuron/run_bench.sh --accelerator cpu                       # tiny random llama
#   DEEPINFER_NEURON_DEVICE=cpu bash examples/neuron/run_bench.sh --accelerator neuron
#   bash examples/neuron/run_bench.sh --accelerator neuron --model /path/to/hf-folder --dp 4 \
#       --dtype bfloat16 --batch-sizes 1,8,32 --input-lens 128,1024 --output-len 64 \
#       --out results/serve_trn2.json -- --max-num-batched-tokens 4096
#
# Options (defaults in brackets):
#   --model DIR            served checkpoint [a tiny random llama written to a temp folder]
#   --accelerator NAME     neuron | nvidia | cpu | ... [DEEPINFER_ACCELERATOR, else the server's pick]
#   --dp N                 engine processes (one device each) [1]
#   --port P               [8000]
#   --batch-sizes LIST     concurrency of each cell [1,4,16]
#   --input-lens LIST      prompt tokens [32,128,512]
#   --output-len N         tokens per request [32]
#   --waves N              timed waves (aiperf: batch x N requests) per cell [2]
#   --dtype D              passed to deepinfer-serve [the checkpoint's]
#   --out PATH             JSON; the PNG, the server log and aiperf's files go beside it
#                          [serve_bench.json]
#   --startup-timeout S    seconds to wait for /health (Neuron compiles graphs at start-up) [1800]
#   --no-aiperf            use serve_bench.py even where aiperf is installed
#   -- ARGS                passed on to deepinfer-serve
# Environment: PYTHON (the interpreter with deepinfer installed) [python3], AIPERF [aiperf].
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
AIPERF="${AIPERF:-aiperf}"
MODEL="" ACCELERATOR="${DEEPINFER_ACCELERATOR:-}" DP=1 PORT=8000
BATCH_SIZES="1,4,16" INPUT_LENS="32,128,512" OUTPUT_LEN=32 WAVES=2 DTYPE=""
OUT="serve_bench.json" STARTUP_TIMEOUT=1800 USE_AIPERF=1
SERVER_ARGS=()

while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --accelerator) ACCELERATOR="$2"; shift 2 ;;
    --dp) DP="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --batch-sizes) BATCH_SIZES="$2"; shift 2 ;;
    --input-lens) INPUT_LENS="$2"; shift 2 ;;
    --output-len) OUTPUT_LEN="$2"; shift 2 ;;
    --waves) WAVES="$2"; shift 2 ;;
    --dtype) DTYPE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --startup-timeout) STARTUP_TIMEOUT="$2"; shift 2 ;;
    --no-aiperf) USE_AIPERF=0; shift ;;
    --) shift; SERVER_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_bench.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

URL="http://127.0.0.1:${PORT}"
STEM="${OUT%.json}"
LOG="${STEM}.server.log"
mkdir -p "$(dirname "$OUT")"
SERVER_PID="" TMP_DIR="" CHILD_PID=""

run() {
  # In the background and waited on: bash runs a trap only once its foreground command is
  # done, so a SIGTERM would otherwise wait for a whole aiperf run before the server stops.
  "$@" &
  CHILD_PID=$!
  wait "$CHILD_PID"
}

stop_server() {
  # SIGTERM: the server stops its rank processes itself. After 60 s, SIGKILL its whole
  # session (setsid below), so that no rank outlives it either.
  [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null || return 0
  kill -TERM "$SERVER_PID" 2>/dev/null || true
  for ((i = 0; i < 60; i++)); do
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 1
  done
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "run_bench.sh: deepinfer-serve ignored SIGTERM for 60 s; killing it" >&2
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || kill -KILL "$SERVER_PID" 2>/dev/null || true
  fi
  wait "$SERVER_PID" 2>/dev/null || true
}

cleanup() {
  local rc=$?
  [[ -z "$CHILD_PID" ]] || kill -TERM "$CHILD_PID" 2>/dev/null || true
  stop_server
  [[ -z "$TMP_DIR" ]] || rm -rf "$TMP_DIR"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT   # through cleanup, via the EXIT trap
trap 'exit 143' TERM

if [[ -z "$MODEL" ]]; then
  TMP_DIR="$(mktemp -d -t deepinfer-tiny-XXXXXX)"
  MODEL="$("$PYTHON" "$HERE/bench_neuron.py" --save-tiny-model "$TMP_DIR/tiny-random-llama" \
           | tail -n 1)"
fi
MAX_BATCH="$(tr ',' '\n' <<<"$BATCH_SIZES" | sort -n | tail -n 1)"

cmd=("$PYTHON" -m deepinfer.serve.cli --model "$MODEL" --port "$PORT" --dp "$DP"
     --served-model-name bench --no-prefix-caching --routing least-loaded
     --max-num-seqs "$MAX_BATCH" --log-level warning)
[[ -z "$ACCELERATOR" ]] || cmd+=(--accelerator "$ACCELERATOR")
[[ -z "$DTYPE" ]] || cmd+=(--dtype "$DTYPE")
cmd+=("${SERVER_ARGS[@]}")
echo "run_bench.sh: ${cmd[*]} (log: $LOG)" >&2
# Its own session, so that the SIGKILL fallback reaches its ranks as well.
if command -v setsid >/dev/null; then
  setsid "${cmd[@]}" >"$LOG" 2>&1 &
else
  "${cmd[@]}" >"$LOG" 2>&1 &
fi
SERVER_PID=$!

healthy() {  # /health answers 200 with every rank up
  "$PYTHON" - "$URL/health" <<'EOF' 2>/dev/null
import json, sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=2) as r:
    sys.exit(0 if r.status == 200 and json.load(r).get("status") == "ok" else 1)
EOF
}

start=$SECONDS
until healthy; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    wait "$SERVER_PID" && rc=0 || rc=$?
    SERVER_PID=""
    echo "run_bench.sh: deepinfer-serve exited ($rc) during start-up; the end of its log:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
  if ((SECONDS - start > STARTUP_TIMEOUT)); then
    echo "run_bench.sh: deepinfer-serve not healthy after ${STARTUP_TIMEOUT} s" >&2
    exit 1
  fi
  sleep 1
done
echo "run_bench.sh: server healthy after $((SECONDS - start)) s" >&2

labels=(--batch-sizes "$BATCH_SIZES" --input-lens "$INPUT_LENS" --output-len "$OUTPUT_LEN"
        --waves "$WAVES" --backend "${ACCELERATOR:-auto}" --dp "$DP" --out "$OUT")
[[ -z "$DTYPE" ]] || labels+=(--dtype "$DTYPE")

if ((USE_AIPERF)) && command -v "$AIPERF" >/dev/null; then
  ARTIFACTS="${STEM}_aiperf"
  for batch in ${BATCH_SIZES//,/ }; do
    for input_len in ${INPUT_LENS//,/ }; do
      dir="$ARTIFACTS/b${batch}_i${input_len}"
      mkdir -p "$dir"
      echo "run_bench.sh: aiperf batch $batch x input $input_len -> $dir" >&2
      # Exactly input_len prompt tokens (by the served checkpoint's tokenizer) and output_len
      # new tokens (EOS ignored), batch requests in flight at a time.
      run "$AIPERF" profile --model bench --tokenizer "$MODEL" --url "$URL" \
        --endpoint-type completions --endpoint /v1/completions --streaming \
        --use-server-token-count \
        --synthetic-input-tokens-mean "$input_len" --synthetic-input-tokens-stddev 0 \
        --output-tokens-mean "$OUTPUT_LEN" --output-tokens-stddev 0 \
        --extra-inputs ignore_eos:true --extra-inputs temperature:0 \
        --concurrency "$batch" --warmup-request-count "$batch" \
        --request-count "$((batch * WAVES))" --random-seed 0 \
        --ui none --artifact-dir "$dir" >"$dir/aiperf.log" 2>&1 \
        || echo "run_bench.sh: aiperf failed for this cell; see $dir/aiperf.log" >&2
    done
  done
  run "$PYTHON" "$HERE/serve_bench.py" --url "$URL" --from-aiperf "$ARTIFACTS" "${labels[@]}"
else
  run "$PYTHON" "$HERE/serve_bench.py" --url "$URL" --model-dir "$MODEL" "${labels[@]}"
fi
