"""deepinfer-serve: the OpenAI-compatible server.

With no --model it serves the embedded default (SmolLM2-135M-Instruct, fetched once from PyPI
and converted into the local cache); with no accelerator the CPU backend serves it.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from typing import Sequence

from deepinfer.core.config import (CacheConfig, EngineConfig, ModelSpec, ParallelConfig,
                                   SchedulerConfig)
from deepinfer.serve.limits import RequestLimits
from deepinfer.serve.rank_health import RankHealthConfig

log = logging.getLogger("deepinfer.serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer-serve", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _model_args(p)
    _server_args(p)
    _engine_args(p)
    _limit_args(p)
    _health_args(p)
    _tokenizer_args(p)
    p.add_argument("--log-level", default="info", type=str.lower,
                   choices=["debug", "info", "warning", "error"], help="log level")
    return p


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF folder or .gguf file; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the model folder's name)")
    p.add_argument("--dtype", default=ModelSpec.dtype, choices=["auto", "float32", "bfloat16",
                                                              "float16"],
                   help="weights and activations; auto: the checkpoint's torch_dtype")
    p.add_argument("--max-model-len", type=int, default=ModelSpec.max_model_len,
                   help="context length (default: the checkpoint's)")
    p.add_argument("--load-format", default=ModelSpec.load_format, choices=["auto", "dummy"],
                   help="dummy: random weights made on the device (benchmarks of a shape)")
    p.add_argument("--generation-config", default="auto", choices=["auto", "none"],
                   help="auto: the checkpoint's generation_config.json sets the sampling "
                        "defaults (temperature, top_p, top_k, min_p, repetition_penalty) of "
                        "requests that leave them unset; none: the OpenAI defaults")


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=os.environ.get("DEEPINFER_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every endpoint but /health "
                        "(also DEEPINFER_API_KEY)")
    p.add_argument("--metrics-public", action="store_true",
                   help="with --api-key: serve /metrics without the key")
    p.add_argument("--accelerator", default=None,
                   help="a backend name or alias (see --list-accelerators; else "
                        "DEEPINFER_ACCELERATOR, else the first available by priority)")
    p.add_argument("--list-accelerators", action="store_true",
                   help="list the backends and plugin failures, then exit")
    p.add_argument("--dp", type=int, default=ParallelConfig.dp,
                   help="engine processes (one per device)")
    p.add_argument("--ep", action="store_true",
                   help="expert parallel: the --dp ranks form one torch.distributed group and "
                        "step in lockstep (an idle rank runs a dummy step), so MoE layers can "
                        "exchange tokens")
    p.add_argument("--routing", default="affinity", choices=["affinity", "least-loaded"],
                   help="how --dp ranks share requests: affinity pins a conversation (session "
                        "header, user field or first user message) to one rank for its prefix "
                        "cache, falling back to the least-loaded rank when it is overloaded; "
                        "least-loaded picks the rank with the fewest queued + running tokens")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=int, default=CacheConfig.block_size,
                   help="tokens per KV block (one prefix-cache page)")
    p.add_argument("--num-kv-blocks", type=int, default=CacheConfig.num_blocks,
                   help="KV blocks per rank (default: sized from the memory flags)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=CacheConfig.kv_cache_memory_gb,
                   help="KV pool of host-memory backends (cpu)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=CacheConfig.gpu_memory_utilization,
                   help="GPU backends: fraction of device memory for weights, activations and "
                        "the KV pool, which gets what a profiling step leaves")
    p.add_argument("--enforce-eager", action="store_true",
                   help="GPU backends: no CUDA graphs")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="no prefix cache (device or host)")
    p.add_argument("--hicache-size-gb", type=float, default=CacheConfig.hicache_size_gb,
                   help="host memory per rank for HiCache, a host tier of KV pages behind the "
                        "device prefix cache (0: off)")
    p.add_argument("--hicache-state-slots", type=int, default=CacheConfig.hicache_state_slots,
                   help="host slots for per-request layer state (models that keep state "
                        "besides KV pages only)")
    p.add_argument("--yoco-keep-tokens", type=int, default=CacheConfig.yoco_keep_tokens,
                   help="a host-tier hit leaves at least this many prompt tokens to recompute")
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs,
                   help="sequences in one step's batch")
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=SchedulerConfig.max_num_batched_tokens,
                   help="tokens in one step (prefill chunks + decodes)")
    p.add_argument("--seed", type=int, default=EngineConfig.seed,
                   help="seed of the per-request seeds of unseeded requests")


def _limit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-n", type=int, default=RequestLimits.max_n,
                   help="most samples (`n`) one request may ask for")
    p.add_argument("--max-prompts", type=int, default=RequestLimits.max_prompts,
                   help="most prompts in one /v1/completions request")
    p.add_argument("--max-stop", type=int, default=RequestLimits.max_stop,
                   help="most stop strings (and stop token ids) in one request")
    p.add_argument("--max-request-body-mb", type=float, default=RequestLimits.max_body_mb,
                   help="larger request bodies are refused with 413")


def _health_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rank-unhealthy-after", type=float,
                   default=RankHealthConfig.unhealthy_after_s,
                   help="seconds without a rank's heartbeat before new requests are routed "
                        "around it")
    p.add_argument("--rank-fail-after", type=float, default=RankHealthConfig.fail_after_s,
                   help="seconds without a heartbeat before the rank is killed, its requests "
                        "fail with 503 and it is restarted")
    p.add_argument("--rank-step-timeout", type=float, default=RankHealthConfig.step_timeout_s,
                   help="seconds one engine step may run before the rank counts as hung")
    p.add_argument("--max-rank-restarts", type=int, default=RankHealthConfig.max_restarts,
                   help="restarts in a row of a rank that dies (backoff doubling from "
                        f"{RankHealthConfig.restart_backoff_s:g} s; a rank that served "
                        f"{RankHealthConfig.stable_after_s:g} s starts over)")


def _tokenizer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer-backend", default="auto",
                   choices=["auto", "fastokens", "segment", "hf"],
                   help="prompt tokenizer; auto probes and picks the first that equals hf")
    p.add_argument("--tokenizer-verify-rate", type=float, default=0.005,
                   help="fraction of prompts re-encoded with hf in the background")
    p.add_argument("--tokenizer-cache-mb", type=int, default=512,
                   help="byte budget of the segment backend's piece cache")


def engine_config(args: argparse.Namespace, model_dir: str) -> EngineConfig:
    return EngineConfig(
        model=ModelSpec(model_dir, args.dtype, args.max_model_len, args.load_format),
        cache=CacheConfig(args.block_size, args.num_kv_blocks, args.kv_cache_memory_gb,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=not args.no_prefix_caching,
                          hicache_size_gb=args.hicache_size_gb,
                          hicache_state_slots=args.hicache_state_slots,
                          yoco_keep_tokens=args.yoco_keep_tokens),
        scheduler=SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs),
        parallel=ParallelConfig(dp=args.dp, ep=args.ep),
        accelerator=args.accelerator, seed=args.seed, enforce_eager=args.enforce_eager)


def request_limits(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(args.max_n, args.max_prompts, args.max_stop, args.max_request_body_mb)


def rank_health(args: argparse.Namespace) -> RankHealthConfig:
    return RankHealthConfig(unhealthy_after_s=args.rank_unhealthy_after,
                            fail_after_s=args.rank_fail_after,
                            step_timeout_s=args.rank_step_timeout,
                            max_restarts=args.max_rank_restarts)


async def serve(args: argparse.Namespace, model_dir: str, listener: socket.socket) -> None:
    import time

    import uvicorn
    from transformers import AutoTokenizer

    from deepinfer.serve.app import ServerState, create_app
    from deepinfer.serve.engine_client import EngineClient
    from deepinfer.serve.metrics import ServerMetrics
    from deepinfer.serve.rank_metrics import RankCollector
    from deepinfer.serve.tokenizer_metrics import TokenizerCollector

    name = args.served_model_name or os.path.basename(os.path.normpath(args.model or model_dir))
    client = EngineClient(engine_config(args, model_dir), args.dp, routing=args.routing,
                          health=rank_health(args))
    try:
        ready = await client.start()
        log.info("%d rank(s) ready on %s: %d KV blocks of %d tokens, context %d", len(ready),
                 ready[0].accelerator, ready[0].num_blocks, ready[0].block_size,
                 ready[0].max_model_len)
        if ready[0].hicache_pages:
            log.info("HiCache: %d host pages of %d tokens per rank", ready[0].hicache_pages,
                     ready[0].block_size)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        metrics = ServerMetrics(name)
        prompt_tokenizer = build_prompt_tokenizer(args, tokenizer)
        metrics.registry.register(TokenizerCollector(prompt_tokenizer, name))
        metrics.registry.register(RankCollector(client.ranks, client.router, name))
        state = ServerState(client, tokenizer, name, model_dir, ready[0].max_model_len,
                            metrics, args.api_key, int(time.time()),
                            prompt_tokenizer=prompt_tokenizer, limits=request_limits(args),
                            sampling_defaults=sampling_defaults(args, model_dir),
                            metrics_public=args.metrics_public)
        config = uvicorn.Config(create_app(state), host=args.host, port=args.port,
                                log_level=args.log_level, timeout_graceful_shutdown=5)
        # uvicorn handles SIGINT/SIGTERM while it serves, then restores the previous handlers
        # and re-raises the signal; with the default handlers that kills the process before
        # the `finally` below can stop the ranks (orphaned ranks, leaked IPC folder).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _swallow_signal)
        try:
            await uvicorn.Server(config).serve(sockets=[listener])
        finally:
            prompt_tokenizer.close()
    finally:
        listener.close()
        await client.shutdown()


def _swallow_signal(signum: int, frame: object) -> None:
    log.info("stopping on signal %d", signum)


def sampling_defaults(args: argparse.Namespace, model_dir: str) -> dict:
    from deepinfer.serve.generation_config import load_sampling_defaults

    if args.generation_config == "none":
        return {}
    defaults = load_sampling_defaults(model_dir)
    if defaults:
        log.info("sampling defaults from the checkpoint's generation_config.json (for "
                 "requests that leave them unset): %s", defaults)
    return defaults


def build_prompt_tokenizer(args: argparse.Namespace, tokenizer):
    """Probe the prompt tokenizer backends and wrap the winner in live verification."""
    from deepinfer.serve.tokenizer import VerifiedTokenizer, select_prompt_tokenizer

    primary, probes = select_prompt_tokenizer(tokenizer, args.tokenizer_backend,
                                              cache_bytes=args.tokenizer_cache_mb << 20)
    for probe in probes:
        log.info("tokenizer backend %s: %s%s", probe.backend, "ok" if probe.ok else "rejected",
                 f" ({probe.reason})" if probe.reason else "")
    log.info("prompt tokenizer: %s (verify rate %g)", primary.name, args.tokenizer_verify_rate)
    return VerifiedTokenizer(primary, tokenizer, rate=args.tokenizer_verify_rate,
                             on_mismatch=lambda m: log.error(
                                 "prompt tokenizer %s mismatched hf; now serving with hf",
                                 m.backend))


def main(argv: Sequence[str] | None = None) -> int:
    from deepinfer.core.plugins import load_plugins
    from deepinfer.serve.preflight import PreflightError, bind_listener, check_args

    registry = load_plugins()
    parser = build_parser()
    registry.add_cli_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.list_accelerators:
        from deepinfer.cli import print_plugins

        print_plugins(registry)
        return 0
    from deepinfer.llm import resolve_model_path

    try:
        check_args(args, registry)
        listener = bind_listener(args.host, args.port)
    except PreflightError as exc:
        print(f"deepinfer-serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        model_dir = resolve_model_path(args.model)
    except (RuntimeError, FileNotFoundError, ValueError) as exc:
        print(f"deepinfer-serve: error: {exc}", file=sys.stderr)
        listener.close()
        return 2
    _run(serve(args, model_dir, listener))
    return 0


def _run(main_coro) -> None:
    """Run on uvloop where it is installed (a faster event loop for many streams)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coro)
        return
    uvloop.run(main_coro)


if __name__ == "__main__":
    sys.exit(main())
