"""The CPU kernels' build lock: a build that was killed leaves torch's lock file behind, and a
later start must not wait on it forever."""
from __future__ import annotations

import multiprocessing as mp
import os

from deepinfer.backends.cpu.kernels import build_lock


def _hold(build: str, holding, release) -> None:
    with build_lock(build):
        holding.set()
        release.wait(30)


def test_a_stale_torch_lock_is_removed_under_the_build_lock(tmp_path):
    stale = tmp_path / "lock"
    stale.write_text("")  # what a build killed mid-compile leaves
    with build_lock(str(tmp_path)):
        assert not stale.exists()


def test_a_live_builder_is_waited_for(tmp_path):
    """While another process holds the build lock (it builds), this one waits; a holder that
    dies drops it (the kernel's flock), so nothing waits on a dead build."""
    ctx = mp.get_context("spawn")
    holding, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), holding, release))
    holder.start()
    assert holding.wait(60)
    (tmp_path / "lock").write_text("")  # torch's lock of the live build: not stale, kept
    holder.kill()  # dies mid-build: its flock goes with it
    holder.join(30)
    with build_lock(str(tmp_path)):
        assert not (tmp_path / "lock").exists()
    assert os.path.exists(tmp_path / "deepinfer-build.lock")
