"""The entry point of a rank process: it sets the rank's environment, then imports the engine
(and torch) there, so that the API process stays free of both."""
from __future__ import annotations

from deepinfer.serve.ranks.spec import RankSpec
from deepinfer.serve.settings import enter_rank_env

# OpenMP threads (torch's CPU kernels, libgomp) spin this many turns before they sleep, unless
# the user sets it: libgomp's default spin is long enough that on a host whose cores are busy
# with other work a step's threads wait on a descheduled peer for seconds (docs/benchmarks.md,
# "One hostile client").
GOMP_SPINCOUNT = "20000"


def run_rank(spec: RankSpec) -> None:
    """Entry point of a rank process (multiprocessing spawn target): the rank's environment,
    then the engine's modules."""
    enter_rank_env(spec.env, GOMP_SPINCOUNT)
    from deepinfer.serve.ranks.engine_proc import run_rank as run

    run(spec)
