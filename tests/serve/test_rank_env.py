"""A backend's rank_env reaches its rank processes: the API process builds each rank's
environment from the named backend's AcceleratorInfo, and the rank sets it before it loads
any plugin or backend."""
from __future__ import annotations

import multiprocessing as mp

import pytest
import zmq

import deepinfer.core.plugins as plugins
from deepinfer.core.config import ENV_ACCELERATOR, EngineConfig, ModelSpec
from deepinfer.core.plugins import AcceleratorInfo
from deepinfer.serve.ranks.supervisor import rank_env_of, rank_envs
from deepinfer.serve.ranks.entry import RankSpec, run_rank
from deepinfer.serve.ranks.ipc import Failed


def cores(rank: int, world: int, base) -> dict[str, str]:
    return {"CORES": f"{rank}/{world}", "BASE": base.get("MARK", "")}


def infos() -> list[AcceleratorInfo]:
    def load():
        raise AssertionError("the API process must not import a backend")

    return [AcceleratorInfo(name="chip", load=load, aliases=("trn",), rank_env=cores),
            AcceleratorInfo(name="trn", load=load),  # its name beats chip's alias
            AcceleratorInfo(name="plain", load=load)]


class _Registry:
    def accelerators(self) -> list[AcceleratorInfo]:
        return infos()


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.delenv(ENV_ACCELERATOR, raising=False)
    monkeypatch.setattr(plugins, "load_plugins", _Registry)


def test_rank_env_of_matches_like_select_accelerator():
    assert rank_env_of(infos(), " CHIP ") is cores
    assert rank_env_of(infos(), "trn") is None
    assert rank_env_of(infos(), "plain") is None
    assert rank_env_of(infos(), "nothing") is None


def test_rank_envs_of_the_named_backend(registry):
    assert rank_envs("chip", 2, {"MARK": "x"}) == [{"CORES": "0/2", "BASE": "x"},
                                                   {"CORES": "1/2", "BASE": "x"}]
    assert rank_envs("plain", 2, {}) == [{}, {}]


def test_rank_envs_named_by_the_environment(registry, monkeypatch):
    monkeypatch.setenv(ENV_ACCELERATOR, "chip")
    assert rank_envs(None, 1, {}) == [{"CORES": "0/1", "BASE": ""}]


def test_no_backend_named_no_plugins_loaded(monkeypatch):
    monkeypatch.delenv(ENV_ACCELERATOR, raising=False)
    monkeypatch.setattr(plugins, "load_plugins", lambda: pytest.fail("plugins were loaded"))
    assert rank_envs(None, 3, {}) == [{}, {}, {}]


def test_spawned_rank_applies_its_env_before_choosing_a_backend(tmp_path):
    # The env names a backend that does not exist: the rank's start-up error then shows that
    # the variable was set in the rank before select_accelerator read it.
    ctx = zmq.Context()
    out = ctx.socket(zmq.PULL)
    out.setsockopt(zmq.RCVTIMEO, 60_000)
    out.bind(f"ipc://{tmp_path}/out")
    spec = RankSpec(0, 1, EngineConfig(model=ModelSpec(str(tmp_path))), (f"ipc://{tmp_path}/in",),
                    (f"ipc://{tmp_path}/out",), env={ENV_ACCELERATOR: "set-by-rank-env"})
    process = mp.get_context("spawn").Process(target=run_rank, args=(spec,), daemon=True)
    process.start()
    try:
        message = out.recv_pyobj()
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
        ctx.destroy(linger=0)
    assert isinstance(message, Failed)
    assert "unknown accelerator 'set-by-rank-env'" in message.error
