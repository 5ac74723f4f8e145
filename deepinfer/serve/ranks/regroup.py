"""A surviving rank's side of a regroup: its expert-parallel group lost a rank, which the API
process restarts. The survivor keeps its model and KV pool: it drops its requests (the API
process failed them when the peer died), leaves the old torch.distributed group and joins a
new one, with the same world size and rank ids, on a fresh port, where the replacement
joins it."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from datetime import timedelta

import zmq

from deepinfer.core.engine import Engine
from deepinfer.serve.ranks.ipc import Control, ControlReply, Regroup
from deepinfer.serve.ranks.lockstep import Lockstep, init_rank_group, shutdown_group
from deepinfer.serve.ranks.outbox import RankOutbox
from deepinfer.serve.ranks.spec import RankSpec
from deepinfer.serve.ranks.stream_pacing import StreamPacer

log = logging.getLogger("deepinfer.rank")
# How long a rank whose collective failed waits for the API process's word. It sends Regroup
# the moment a peer's process ends; a failure no death explains ends the rank after this.
GROUP_LOSS_WAIT_S = 30.0
POLL_MS = 200  # between checks that the parent process is alive


def await_regroup(inbox: zmq.Socket, outbox: RankOutbox, parent: int,
                  wait_s: float = GROUP_LOSS_WAIT_S) -> Regroup | None:
    """After a collective failed: the Regroup the API process sends, or None (a shutdown, an
    orphaned rank, or no word in time)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and os.getppid() == parent:
        if not inbox.poll(POLL_MS):
            continue
        message = inbox.recv_pyobj()
        if isinstance(message, Regroup):
            return message
        if isinstance(message, Control) and message.command == "shutdown":
            outbox.reply(message.client, ControlReply(message.call_id, True))
            return None
        # Anything else was sent before the API process knew, and it failed those requests.
    return None


def rejoin(engine: Engine, spec: RankSpec, regroup: Regroup, outbox: RankOutbox,
           pacer: StreamPacer) -> Lockstep:
    """Leave the old group, join the new one and take it into the engine; the new vote."""
    shutdown_group()
    parallel = dataclasses.replace(spec.config.parallel, master_port=regroup.master_port)
    started = time.monotonic()
    context = init_rank_group(parallel, spec.rank, engine.accelerator.distributed_backend,
                              timedelta(seconds=regroup.timeout_s), regroup.placement_from)
    dropped = engine.rejoin_group(context)
    for request_id in dropped:
        pacer.drop(request_id)
        outbox.forget(request_id)
    lockstep = Lockstep()
    log.info("joined the new rank group on port %d after %.2f s (the replacement's start), "
             "%d request(s) dropped", regroup.master_port, time.monotonic() - started,
             len(dropped))
    return lockstep
