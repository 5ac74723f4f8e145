"""A rank loop (engine_proc._loop) run on a thread of the test, over inproc sockets, with the
core tests' fake accelerator: what the rank-loop tests share."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import zmq

from deepinfer.core.config import CacheConfig, EngineConfig, ModelSpec, SchedulerConfig
from deepinfer.serve.ranks.outbox import RankOutbox

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "core"))
from fakes import PagedFakeAccelerator, write_config  # noqa: E402

__all__ = ["PagedFakeAccelerator", "RankWires", "fake_config", "rank_wires"]


@dataclass
class RankWires:
    ctx: zmq.Context
    to_rank: zmq.Socket  # the test sends requests here
    rank_in: zmq.Socket  # the loop's inbox
    rank_out: RankOutbox  # the loop's outbox (one API process)
    from_rank: zmq.Socket  # the test reads results here (a broken loop times out, not hangs)


def rank_wires(name: str) -> RankWires:
    ctx = zmq.Context()
    to_rank, rank_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    from_rank = ctx.socket(zmq.PULL)
    to_rank.bind(f"inproc://{name}-in")
    rank_in.connect(f"inproc://{name}-in")
    from_rank.setsockopt(zmq.RCVTIMEO, 10_000)
    from_rank.bind(f"inproc://{name}-out")
    rank_out = RankOutbox(ctx, (f"inproc://{name}-out",))
    return RankWires(ctx, to_rank, rank_in, rank_out, from_rank)


def fake_config(tmp_path, num_blocks: int) -> EngineConfig:
    """A fake-model engine: 16-token blocks, 64-token steps."""
    return EngineConfig(model=ModelSpec(write_config(str(tmp_path / "fake"))),
                        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_num_batched_tokens=64))
