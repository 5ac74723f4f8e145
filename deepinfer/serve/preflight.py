"""Checks of deepinfer-serve's flags that run before anything heavy (a model download, a
conversion, rank processes): each failure is one line for the user, never a traceback."""
from __future__ import annotations

import argparse
import logging
import os
import resource
import socket
import subprocess
import sys

from deepinfer.serve.settings import process_env

CHOSEN = "accelerator="  # the probe's line that names the backend it chose


class PreflightError(Exception):
    """A flag that cannot work; the message is the whole story."""


def check_args(args: argparse.Namespace) -> str:
    """Everything that can be known wrong from the flags alone; the accelerator's exact name,
    chosen here once for the ranks to load."""
    from deepinfer.serve.flags import connection_limits, engine_config, rank_health, request_limits

    if args.dp < 1:
        raise PreflightError(f"--dp must be >= 1, got {args.dp}")
    if not 0 <= args.port <= 65535:
        raise PreflightError(f"--port must be in [0, 65535], got {args.port}")
    if not 0.0 <= args.tokenizer_verify_rate <= 1.0:
        raise PreflightError("--tokenizer-verify-rate must be in [0, 1]")
    if args.api_server_count < 1:
        raise PreflightError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.stream_interval < 1:
        raise PreflightError(f"--stream-interval must be >= 1, got {args.stream_interval}")
    if not args.timeout_keep_alive > 0:
        raise PreflightError(f"--timeout-keep-alive must be > 0 seconds, got "
                             f"{args.timeout_keep_alive}")
    check_connection_args(args)
    try:
        engine_config(args, args.model or ".")
        request_limits(args)
        rank_health(args)
        connection_limits(args)
    except ValueError as exc:
        raise PreflightError(str(exc)) from exc
    check_model_path(args.model)
    check_experts(args)
    check_host_cache(args)
    accelerator = check_accelerator(args.accelerator, args.model if args.model and
                                    os.path.isdir(args.model) else None,
                                    args.load_format != "dummy")
    check_rank_env(accelerator, args.dp)
    return accelerator


def api_key(args: argparse.Namespace, argv: list[str]) -> str | None:
    """The key the API requires: --api-key-file's first line, else --api-key (which defaults
    to DEEPINFER_API_KEY). A key typed on the command line is readable by anyone who can list
    processes, so that gets a warning naming the ways that are not."""
    if args.api_key_file is None:
        if any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
            logging.getLogger("deepinfer.serve").warning(
                "--api-key on the command line is visible to other users of this machine "
                "(ps); prefer DEEPINFER_API_KEY or --api-key-file")
        return args.api_key or None
    if any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        raise PreflightError("give --api-key or --api-key-file, not both")
    try:
        with open(args.api_key_file) as f:
            key = f.readline().strip()
    except OSError as exc:
        raise PreflightError(f"--api-key-file {args.api_key_file}: {exc.strerror}") from exc
    if not key:
        raise PreflightError(f"--api-key-file {args.api_key_file}: the first line is empty")
    return key


def check_connection_args(args: argparse.Namespace) -> None:
    if args.max_stream_backlog < 1:
        raise PreflightError(f"--max-stream-backlog must be >= 1, got {args.max_stream_backlog}")
    if not args.large_body_kb > 0:
        raise PreflightError(f"--large-body-kb must be > 0, got {args.large_body_kb}")
    if args.shutdown_timeout < 0:
        raise PreflightError(f"--shutdown-timeout must be >= 0 seconds, got "
                             f"{args.shutdown_timeout}")


def check_rank_env(accelerator: str, ranks: int) -> None:
    """The chosen backend's per-rank environment (e.g. the Neuron cores of each rank) must be
    possible for `ranks` ranks (--dp): an impossible core layout is a one-line error here."""
    from deepinfer.serve.ranks.supervisor import rank_envs

    try:
        rank_envs(accelerator, ranks, process_env())  # the ranks of this host
    except ValueError as exc:
        raise PreflightError(str(exc)) from exc


def check_experts(args: argparse.Namespace) -> None:
    """EPLB's flags against the checkpoint's experts (read from an HF folder's config)."""
    redundant = args.eplb_redundant_experts
    if not (args.eplb_interval > 0 or args.eplb_after_prefill or redundant):
        return
    if not args.model or not os.path.isdir(args.model):
        raise PreflightError("--eplb-* flags need an MoE checkpoint folder as --model")
    from deepinfer.models.registry import expert_count

    experts, ranks = expert_count(args.model), args.dp * args.nnodes
    if not experts:
        raise PreflightError(f"--eplb-* flags need an MoE checkpoint; {args.model} has no "
                             f"experts")
    if ranks < 2 or args.no_ep:
        raise PreflightError("EPLB balances experts across expert-parallel ranks: it needs "
                             "several ranks (--dp, --nnodes) and expert parallel (no --no-ep)")
    if (experts + redundant) % ranks:
        raise PreflightError(f"--eplb-redundant-experts {redundant}: {experts} experts + "
                             f"{redundant} must divide by the {ranks} ranks")


def check_model_path(model: str | None) -> None:
    if model is None:
        return  # the embedded default
    if not os.path.exists(model):
        raise PreflightError(f"--model {model}: no such file or folder")
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise PreflightError(f"--model {model}: the folder has no config.json (an HF "
                                 "checkpoint folder or a .gguf file is needed)")
    elif not model.endswith(".gguf"):
        raise PreflightError(f"--model {model}: a file must be a .gguf checkpoint")
    else:
        from deepinfer.models.checkpoint_check import CheckpointError, check_gguf

        try:
            check_gguf(model)
        except CheckpointError as exc:
            raise PreflightError(f"--model {exc}") from exc


def check_host_cache(args: argparse.Namespace) -> None:
    """HiCache pins its whole pool at start-up in every rank of this host: more than the
    machine has free would fail (or swap) only once the ranks allocate it."""
    wanted = args.hicache_size_gb * args.dp
    available = available_memory_gb()
    if wanted > available:
        raise PreflightError(f"--hicache-size-gb {args.hicache_size_gb:g} x {args.dp} rank(s) "
                             f"needs {wanted:g} GiB of host memory; {available:.1f} GiB is "
                             "available")


def available_memory_gb() -> float:
    """Host memory free for new allocations (MemAvailable: free plus reclaimable cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / (1 << 30)


def check_accelerator(name: str | None, model_dir: str | None = None,
                      read_weights: bool = True) -> str:
    """The backend the ranks will load, chosen (`name`, an alias, DEEPINFER_ACCELERATOR or
    the probe) and its exact name returned, and the model folder checked (config.json builds
    its family's model, the weight files' headers are whole), in a short-lived process: both
    import torch, and the API process serves without it."""
    command = [sys.executable, "-m", "deepinfer.serve.preflight", name or ""]
    if model_dir is not None:
        command += [model_dir, "weights" if read_weights else "config"]
    probe = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    chosen = [line[len(CHOSEN):] for line in probe.stdout.splitlines()
              if line.startswith(CHOSEN)]
    if probe.returncode == 0 and chosen:
        return chosen[-1]
    said, crashed = probe.stdout.strip().splitlines(), probe.stderr.strip().splitlines()
    # The check's own error line, else the last line of a traceback (the exception).
    raise PreflightError(said[0] if said else crashed[-1] if crashed else
                         f"the accelerator probe exited with {probe.returncode}")


def _probe(name: str, model_dir: str | None, read_weights: bool) -> int:
    """check_accelerator's process: the chosen backend's name after CHOSEN, or the first
    line of an error and exit status 1."""
    from deepinfer.core.plugins import AcceleratorError, choose_accelerator, load_plugins
    from deepinfer.models.checkpoint_check import CheckpointError, check_hf_folder

    try:
        chosen = choose_accelerator(load_plugins(), name or None).name
        if model_dir is not None:
            check_hf_folder(model_dir, read_weights)
    except (ValueError, AcceleratorError) as exc:
        print(("--model " if isinstance(exc, CheckpointError) else "")
              + str(exc).splitlines()[0])
        return 1
    print(CHOSEN + chosen)
    return 0


def raise_open_file_limit(wanted: int = 65536) -> int:
    """Every stream holds a socket, and the common soft limit of 1,024 open files would stop
    a server from accepting its 1,024th stream (with the rank sockets, fewer). Raise the soft
    limit toward the hard one, as vLLM does; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # kept as it is: the server still runs, with fewer possible streams
    return soft


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now, so a busy port fails before the model loads
    (uvicorn serves on this very socket: no window for another process to take the port)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise PreflightError(f"--host {host}: {exc.strerror}") from exc
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise PreflightError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    sys.exit(_probe(sys.argv[1] if len(sys.argv) > 1 else "",
                    sys.argv[2] if len(sys.argv) > 2 else None,
                    len(sys.argv) <= 3 or sys.argv[3] == "weights"))
