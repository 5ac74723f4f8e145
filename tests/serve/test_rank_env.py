"""The backend is chosen once, by the preflight, and its exact name travels to the ranks: the
API process builds each rank's environment from that backend's AcceleratorInfo (no choosing
there), the rank sets it before it loads any plugin or backend, and loads the backend by name."""
from __future__ import annotations

import multiprocessing as mp

import pytest
import zmq

import deepinfer.core.plugins as plugins
from deepinfer.core.config import ENV_ACCELERATOR, EngineConfig, ModelSpec
from deepinfer.core.plugins import AcceleratorInfo, find_accelerator, load_accelerator
from deepinfer.serve import preflight
from deepinfer.serve.flags import build_parser, engine_config
from deepinfer.serve.ranks.entry import run_rank
from deepinfer.serve.ranks.ipc import Failed
from deepinfer.serve.ranks.spec import RankSpec
from deepinfer.serve.ranks.supervisor import rank_envs


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


def test_find_accelerator_exact_name_beats_alias():
    assert find_accelerator(infos(), " CHIP ").name == "chip"
    assert find_accelerator(infos(), "trn").name == "trn"  # chip's alias, but trn's own name
    assert find_accelerator(infos(), "nothing") is None


def test_rank_envs_of_the_named_backend(registry):
    assert rank_envs("chip", 2, {"MARK": "x"}) == [{"CORES": "0/2", "BASE": "x"},
                                                   {"CORES": "1/2", "BASE": "x"}]
    assert rank_envs("plain", 2, {}) == [{}, {}]


def test_preflight_chooses_once_and_the_ranks_get_the_chosen_name(registry, monkeypatch):
    # The preflight's probe process (stubbed here) chooses chip; from then on only that exact
    # name is used: the rank envs and the config every rank gets.
    chosen = []
    monkeypatch.setattr(preflight, "check_accelerator",
                        lambda name, *rest: chosen.append(name) or "chip")
    monkeypatch.setattr(plugins, "choose_accelerator",
                        lambda *a: pytest.fail("chosen again after the preflight"))
    args = build_parser().parse_args(["--dp", "2", "--load-format", "dummy"])
    args.accelerator = preflight.check_args(args)
    assert chosen == [None] and args.accelerator == "chip"
    config = engine_config(args, ".")
    assert config.accelerator == "chip"
    assert rank_envs(config.accelerator, 2, {}) == [{"CORES": "0/2", "BASE": ""},
                                                    {"CORES": "1/2", "BASE": ""}]


def test_a_rank_loads_the_chosen_backend_by_name_without_probing():
    loaded = []

    def load():
        loaded.append("chip")
        return object

    class Registry:
        failures = []

        def accelerators(self):
            return [AcceleratorInfo(name="chip", load=load, probe=lambda: pytest.fail("probed")),
                    AcceleratorInfo(name="other", load=lambda: pytest.fail("other loaded"),
                                    priority=9)]

    assert load_accelerator(Registry(), "chip") is object and loaded == ["chip"]
    with pytest.raises(ValueError, match="unknown accelerator 'gone'"):
        load_accelerator(Registry(), "gone")


def test_no_backend_chosen_no_plugins_loaded(monkeypatch):
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
