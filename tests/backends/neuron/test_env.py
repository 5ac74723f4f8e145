"""Per-rank NeuronCore setup as a pure function: exclusive core ranges for every --dp, slices of
an inherited NEURON_RT_VISIBLE_CORES, the runtime settings, and one-line errors for layouts that
cannot work."""
from __future__ import annotations

import pytest

from deepinfer.backends.neuron.env import (
    NeuronRankSetup,
    parse_cores,
    plugin_rank_env,
    rank_env,
    settings_from_env,
)

VISIBLE = "NEURON_RT_VISIBLE_CORES"


def visible_of(setup: NeuronRankSetup, world: int, base: dict | None = None) -> list[str]:
    return [rank_env(setup, r, world, base or {})[VISIBLE] for r in range(world)]


@pytest.mark.parametrize("world, expected", [
    (1, ["0-3"]), (2, ["0-3", "4-7"]), (4, ["0-3", "4-7", "8-11", "12-15"])])
def test_ranges_per_dp(world, expected):
    assert visible_of(NeuronRankSetup(cores_per_rank=4), world) == expected


def test_one_core_per_rank_is_a_single_index():
    assert visible_of(NeuronRankSetup(cores_per_rank=1, total_cores=2), 2) == ["0", "1"]


def test_even_share_of_the_total():
    assert visible_of(NeuronRankSetup(total_cores=16), 4) == ["0-3", "4-7", "8-11", "12-15"]


def test_one_rank_with_nothing_known_takes_every_core():
    assert VISIBLE not in rank_env(NeuronRankSetup(), 0, 1, {})


def test_slices_an_inherited_visible_range():
    base = {VISIBLE: "8-15"}
    assert visible_of(NeuronRankSetup(cores_per_rank=4), 2, base) == ["8-11", "12-15"]
    assert visible_of(NeuronRankSetup(), 4, base) == ["8-9", "10-11", "12-13", "14-15"]
    assert visible_of(NeuronRankSetup(total_cores=4), 2, base) == ["8-9", "10-11"]


def test_inherited_list_with_a_gap_between_ranks_is_fine():
    base = {VISIBLE: "0-3,8-11"}
    assert visible_of(NeuronRankSetup(cores_per_rank=4), 2, base) == ["0-3", "8-11"]


def test_parse_cores():
    assert parse_cores("3-5,6") == [3, 4, 5, 6]
    assert parse_cores(" 7 ") == [7]


@pytest.mark.parametrize("setup, world, base, message", [
    (NeuronRankSetup(cores_per_rank=4), 3, {VISIBLE: "0-7"}, "need 12, only 8"),
    (NeuronRankSetup(cores_per_rank=4, total_cores=8), 4, {}, "need 16, only 8"),
    (NeuronRankSetup(total_cores=16), 2, {VISIBLE: "0-7"}, "more than the 8 cores"),
    (NeuronRankSetup(), 2, {VISIBLE: "0-3,2-5"}, "overlapping"),
    (NeuronRankSetup(), 4, {VISIBLE: "0-2"}, "only 3 visible"),
    (NeuronRankSetup(), 2, {}, "needs their count"),
    (NeuronRankSetup(cores_per_rank=2), 2, {VISIBLE: "0,2,4,6"}, "not one contiguous"),
    (NeuronRankSetup(), 1, {VISIBLE: "0-x"}, "not a list of cores"),
])
def test_impossible_layouts(setup, world, base, message):
    with pytest.raises(ValueError, match=message) as info:
        for rank in range(world):
            rank_env(setup, rank, world, base)
    assert "\n" not in str(info.value)


def test_rank_outside_the_world():
    with pytest.raises(ValueError, match="outside"):
        rank_env(NeuronRankSetup(cores_per_rank=1), 2, 2, {})


def test_bad_settings():
    for kwargs in ({"logical_nc_config": 3}, {"cores_per_rank": -1}, {"exec_timeout_s": -5},
                   {"root_comm": "no-port"}, {"root_comm": "host:99999"}):
        with pytest.raises(ValueError):
            NeuronRankSetup(**kwargs)


def test_runtime_settings_and_basic_mode():
    setup = NeuronRankSetup(cores_per_rank=2, logical_nc_config=1, root_comm="10.0.0.1:46820",
                            exec_timeout_s=120, basic_mode=True)
    assert rank_env(setup, 1, 2, {}) == {
        VISIBLE: "2-3", "NEURON_LOGICAL_NC_CONFIG": "1",
        "NEURON_RT_ROOT_COMM_ID": "10.0.0.1:46820", "NEURON_RT_EXEC_TIMEOUT": "120",
        "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS": "0"}


def test_defaults_set_only_the_cores():
    assert rank_env(NeuronRankSetup(cores_per_rank=1), 0, 1, {}) == {VISIBLE: "0"}


def test_pure_and_deterministic():
    setup, base = NeuronRankSetup(cores_per_rank=2, basic_mode=True), {VISIBLE: "4-11"}
    frozen = dict(base)
    assert [rank_env(setup, 3, 4, base) for _ in range(3)] == [rank_env(setup, 3, 4, base)] * 3
    assert base == frozen


def test_settings_from_env():
    environ = {"DEEPINFER_NEURON_CORES_PER_RANK": "8", "DEEPINFER_NEURON_TOTAL_CORES": " ",
               "DEEPINFER_NEURON_LOGICAL_NC_CONFIG": "2", "DEEPINFER_NEURON_BASIC_MODE": "yes",
               "DEEPINFER_NEURON_ROOT_COMM": "localhost:48620",
               "DEEPINFER_NEURON_EXEC_TIMEOUT_S": "60"}
    assert settings_from_env(environ) == NeuronRankSetup(
        cores_per_rank=8, logical_nc_config=2, basic_mode=True, root_comm="localhost:48620",
        exec_timeout_s=60)
    assert settings_from_env({}) == NeuronRankSetup()


def test_settings_from_env_names_the_bad_variable():
    with pytest.raises(ValueError, match="DEEPINFER_NEURON_CORES_PER_RANK='four'"):
        settings_from_env({"DEEPINFER_NEURON_CORES_PER_RANK": "four"})
    with pytest.raises(ValueError, match="DEEPINFER_NEURON_BASIC_MODE"):
        settings_from_env({"DEEPINFER_NEURON_BASIC_MODE": "maybe"})


def test_plugin_rank_env_reads_the_setup_from_the_inherited_environment():
    base = {"DEEPINFER_NEURON_CORES_PER_RANK": "2", VISIBLE: "4-7"}
    assert [plugin_rank_env(r, 2, base) for r in range(2)] == [{VISIBLE: "4-5"}, {VISIBLE: "6-7"}]
