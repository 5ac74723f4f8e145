#!/usr/bin/env bash
# Run deepinfer-serve in the background as its own process group.
#
#   server.sh start [deepinfer-serve args]  start it, wait until /health answers, print the pid
#   server.sh stop [--port N]               SIGTERM the whole group, wait, SIGKILL stragglers
#   server.sh status [--port N]             pid, group members, address, /health; exit 3 when
#                                           nothing runs, 1 when only stragglers are left
#
# Each server's files are keyed by its port (deepinfer-serve's --port, default 8000), so servers
# on different ports never share them: `stop --port N` stops only the server on port N.
#
# The server (the API process, its engine rank processes and multiprocessing's helpers) shares
# one process group whose id is the server's pid, so `stop` reaches every helper even after the
# API process is gone, and nothing is left holding a device.
#
# Environment:
#   DEEPINFER_RUN_DIR        folder of one server's files below, whatever its port (default
#                            $DEEPINFER_CACHE_DIR/run/port-<port>, the cache dir defaulting to
#                            ~/.cache/deepinfer as for the model cache)
#   DEEPINFER_PID_FILE       pid file (default $DEEPINFER_RUN_DIR/server.pid)
#   DEEPINFER_LOG_FILE       server output, appended (default $DEEPINFER_RUN_DIR/server.log)
#   DEEPINFER_PYTHON         the interpreter that has deepinfer installed (default python3)
#   DEEPINFER_START_TIMEOUT  seconds `start` waits for /health (default 600: a first start may
#                            fetch and convert the default model)
#   DEEPINFER_STOP_TIMEOUT   seconds `stop` waits after SIGTERM before SIGKILL (default 30)
set -euo pipefail

DEFAULT_PORT=8000  # deepinfer-serve's --port default
PYTHON="${DEEPINFER_PYTHON:-python3}"
START_TIMEOUT="${DEEPINFER_START_TIMEOUT:-600}"
STOP_TIMEOUT="${DEEPINFER_STOP_TIMEOUT:-30}"

usage() {
    echo "usage: server.sh start [deepinfer-serve args] | stop [--port N] | status [--port N]" >&2
    exit 2
}

# The port from --port arguments (the last one wins, as in argparse), else the default.
arg_port() {
    local port="$DEFAULT_PORT"
    while [ $# -gt 0 ]; do
        case "$1" in
            --port) port="${2:-$port}"; [ $# -lt 2 ] || shift ;;
            --port=*) port="${1#--port=}" ;;
        esac
        shift
    done
    echo "$port"
}

# RUN_DIR, PID_FILE, LOG_FILE, URL_FILE of the server on port $1. Without DEEPINFER_RUN_DIR the
# folder is per port, under the same cache dir as the models (DEEPINFER_CACHE_DIR), so neither
# a second port nor a second cache dir shares (and then stops) another server's pid file.
set_paths() {
    local cache="${DEEPINFER_CACHE_DIR:-${HOME:-/tmp}/.cache/deepinfer}"
    RUN_DIR="${DEEPINFER_RUN_DIR:-$cache/run/port-$1}"
    PID_FILE="${DEEPINFER_PID_FILE:-$RUN_DIR/server.pid}"
    LOG_FILE="${DEEPINFER_LOG_FILE:-$RUN_DIR/server.log}"
    URL_FILE="${PID_FILE%.pid}.url"
}

# "(pid files for ports: ...)" when, in the default per-port layout, servers of other ports
# have pid files: a bare `stop` (port 8000) then tells which --port was meant.
other_servers_hint() {
    local cache="${DEEPINFER_CACHE_DIR:-${HOME:-/tmp}/.cache/deepinfer}" f ports=""
    [ -z "${DEEPINFER_RUN_DIR:-}${DEEPINFER_PID_FILE:-}" ] || return 0
    for f in "$cache"/run/port-*/server.pid; do
        [ -f "$f" ] || continue
        f="${f%/server.pid}"
        ports="$ports ${f##*/port-}"
    done
    [ -z "$ports" ] || echo "; pid files for port(s)$ports: pass --port"
}

# The port the server of $URL_FILE was started with (empty when unknown).
recorded_port() {
    local url
    url="$(cat "$URL_FILE" 2>/dev/null)" || return 0
    echo "${url##*:}"
}

# Live (non-zombie) members of process group $1, one "pid ppid etime args" line each.
members() {
    ps -e -o pid=,pgid=,ppid=,stat=,etime=,args= |
        awk -v g="$1" '$2 == g && $4 !~ /^Z/ { $2 = ""; $4 = ""; print }' |
        sed -E 's/ +/ /g; s/^ //'
}

group_alive() { [ -n "$(members "$1")" ]; }

read_pid() {
    [ -f "$PID_FILE" ] || return 1
    local pid
    pid="$(tr -dc '0-9' <"$PID_FILE")"
    [ -n "$pid" ] || return 1
    echo "$pid"
}

# The URL clients reach, from the --host/--port arguments (deepinfer-serve's defaults otherwise).
server_url() {
    local host=127.0.0.1 port=8000
    while [ $# -gt 0 ]; do
        case "$1" in
            --host) host="${2:-$host}"; shift ;;
            --host=*) host="${1#--host=}" ;;
            --port) port="${2:-$port}"; shift ;;
            --port=*) port="${1#--port=}" ;;
        esac
        shift
    done
    case "$host" in 0.0.0.0 | "::" | "") host=127.0.0.1 ;; esac
    case "$host" in *:*) host="[$host]" ;; esac
    echo "http://$host:$port"
}

# Prints /health's body; succeeds once the server answers at all (a 503 body is an answer).
probe_health() {
    "$PYTHON" - "$1/health" <<'EOF'
import sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=2) as r:
        print(r.read().decode())
except urllib.error.HTTPError as e:
    print(e.read().decode())
except OSError:
    sys.exit(1)
EOF
}

cmd_start() {
    local pid url deadline
    if pid="$(read_pid)" && group_alive "$pid"; then
        echo "deepinfer server already running: pid $pid ($(cat "$URL_FILE" 2>/dev/null)," \
            "pid file $PID_FILE)" >&2
        exit 1
    fi
    mkdir -p "$(dirname "$PID_FILE")" "$(dirname "$LOG_FILE")"
    url="$(server_url "$@")"
    echo "=== $(date '+%F %T') start: $*" >>"$LOG_FILE"
    # os.setsid() makes the server the leader of a new session and process group (like
    # setsid(1), which some systems lack); the engine ranks it spawns inherit the group.
    "$PYTHON" -c 'import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' \
        "$PYTHON" -m deepinfer.serve.cli "$@" >>"$LOG_FILE" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$PID_FILE"
    echo "$url" >"$URL_FILE"
    deadline=$((SECONDS + START_TIMEOUT))
    until probe_health "$url" >/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "deepinfer server exited during start-up; last lines of $LOG_FILE:" >&2
            tail -n 20 "$LOG_FILE" >&2
            stop_group "$pid" >/dev/null
            exit 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "deepinfer server not healthy after ${START_TIMEOUT}s; stopping it" >&2
            stop_group "$pid"
            exit 1
        fi
        sleep 0.5
    done
    echo "deepinfer server running: pid $pid, $url, log $LOG_FILE"
}

# SIGTERM the group (the API process stops its ranks), wait, then SIGKILL whatever is left.
stop_group() {
    local pgid="$1" deadline
    kill -TERM -- "-$pgid" 2>/dev/null || true
    deadline=$((SECONDS + STOP_TIMEOUT))
    while group_alive "$pgid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
    if group_alive "$pgid"; then
        echo "still running after ${STOP_TIMEOUT}s, killing: $(members "$pgid" | cut -d' ' -f1 | xargs)"
        kill -KILL -- "-$pgid" 2>/dev/null || true
        deadline=$((SECONDS + 10))
        while group_alive "$pgid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
    fi
    # Reap the leader if it is our own child (start-up failures); others are reaped by init.
    wait "$pgid" 2>/dev/null || true
    rm -f "$PID_FILE" "$URL_FILE"
    if group_alive "$pgid"; then
        echo "could not stop process group $pgid:" >&2
        members "$pgid" >&2
        return 1
    fi
}

cmd_stop() {
    local pid
    if ! pid="$(read_pid)"; then
        echo "deepinfer server not running (no pid file $PID_FILE$(other_servers_hint))"
        return 0
    fi
    if other_port; then
        echo "deepinfer server not running on port $PORT ($PID_FILE is the server on port" \
            "$(recorded_port)); left alone"
        return 0
    fi
    if ! group_alive "$pid"; then
        rm -f "$PID_FILE" "$URL_FILE"
        echo "deepinfer server not running (removed stale pid file)"
        return 0
    fi
    stop_group "$pid"
    echo "deepinfer server stopped (process group $pid)"
}

cmd_status() {
    local pid url
    if ! pid="$(read_pid)"; then
        echo "deepinfer server not running (no pid file $PID_FILE$(other_servers_hint))"
        exit 3
    fi
    if other_port; then
        echo "deepinfer server not running on port $PORT ($PID_FILE is the server on port" \
            "$(recorded_port))"
        exit 3
    fi
    url="$(cat "$URL_FILE" 2>/dev/null || echo unknown)"
    if ! group_alive "$pid"; then
        echo "deepinfer server not running (stale pid file $PID_FILE)"
        exit 3
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "deepinfer server pid $pid is gone, but its group still runs (run stop):"
        members "$pid"
        exit 1
    fi
    echo "deepinfer server running: pid $pid, $url, log $LOG_FILE"
    echo "process group $pid (pid ppid elapsed command):"
    members "$pid" | sed 's/^/  /'
    echo "health: $(probe_health "$url" || echo 'no answer')"
}

# stop/status take only --port; true when it names a port other than the recorded one (an
# explicit DEEPINFER_RUN_DIR or pid file is one server's, whatever its port), so that
# `stop --port N` never stops a server on another port.
other_port() {
    local recorded
    [ "$PORT_GIVEN" = 1 ] || return 1
    recorded="$(recorded_port)"
    [ -n "$recorded" ] && [ "$recorded" != "$PORT" ]
}

check_port_args() {
    while [ $# -gt 0 ]; do
        case "$1" in
            --port) [ $# -ge 2 ] || usage; shift ;;
            --port=*) ;;
            *) usage ;;
        esac
        shift
    done
}

ACTION="${1:-}"
[ $# -eq 0 ] || shift
case "$ACTION" in
    start) ;;
    stop | status) check_port_args "$@" ;;
    *) usage ;;
esac
PORT="$(arg_port "$@")"
case "$PORT" in
    "" | *[!0-9]*) echo "server.sh: --port must be a number, got '$PORT'" >&2; exit 2 ;;
esac
PORT_GIVEN=0  # stop/status: whether --port picked the server (their only arguments)
[ "$ACTION" = start ] || [ $# -eq 0 ] || PORT_GIVEN=1
set_paths "$PORT"
case "$ACTION" in
    start) cmd_start "$@" ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
esac
