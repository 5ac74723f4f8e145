"""The engine settings have one source: the config dataclasses' fields. Each is a
deepinfer-serve flag and an LLM(...) keyword with the field's default and help, and both
build the same EngineConfig. No model is loaded here."""
from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any

import pytest

from deepinfer import LLM
from deepinfer.core.config import (
    EngineConfig,
    EngineOption,
    ModelSpec,
    engine_config_from_options,
    engine_options,
)
from deepinfer.llm import llm_engine_config
from deepinfer.serve.flags import build_parser, engine_config

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "configuration.md")

# Fields the engine sets itself: the model path (LLM's `model`, --model) and the rendezvous.
INTERNAL = {("model", "path")}

# A non-default value per option where the generic rule below would be invalid.
VALUES = {"tp": 1}  # the only tensor parallel size there is yet


def all_fields() -> list[tuple[str | None, dataclasses.Field]]:
    """Every leaf field of EngineConfig and its sections, walked here independently of
    engine_options(), so a field that the table misses is caught."""
    hints = typing.get_type_hints(EngineConfig)
    leaves = [(None, f) for f in dataclasses.fields(EngineConfig)
              if not dataclasses.is_dataclass(hints[f.name])]
    for section in dataclasses.fields(EngineConfig):
        if dataclasses.is_dataclass(hints[section.name]):
            leaves += [(section.name, f) for f in dataclasses.fields(hints[section.name])]
    return leaves


def other_value(option: EngineOption) -> Any:
    """A valid value different from the default (for the round trip through flags)."""
    if option.name in VALUES:
        return VALUES[option.name]
    if option.type is bool:
        return not option.default
    if option.choices:
        return next(c for c in reversed(option.choices) if c != option.default)
    if option.type is int:
        return 64 if option.default is None else option.default + 1
    if option.type is float:
        return option.default / 2 if option.default else 0.25
    return f"{option.name}-value"


def as_argv(option: EngineOption, value: Any) -> list[str]:
    if option.type is bool:
        return [option.flag] if value != option.default else []
    return [option.flag, str(value)]


def read_back(config: EngineConfig, option: EngineOption) -> Any:
    holder = config if option.section is None else getattr(config, option.section)
    return getattr(holder, option.name)


def test_every_field_is_a_flag_and_an_llm_option_unless_internal():
    parser_flags = build_parser()._option_string_actions
    by_name = {option.name: option for option in engine_options()}
    internal = set()
    for section, f in all_fields():
        if f.metadata.get("internal"):
            internal.add((section, f.name))
            continue
        option = by_name[f.name]
        assert option.section == section
        assert option.flag in parser_flags, f"{f.name}: no flag {option.flag}"
        llm_engine_config("m", **{f.name: option.default})  # an accepted keyword
    assert internal == INTERNAL
    assert len(by_name) == len(engine_options()), "field names must be unique across sections"


def test_defaults_are_the_dataclass_defaults():
    args = build_parser().parse_args([])
    assert engine_config(args, "m") == EngineConfig(ModelSpec("m"))
    assert llm_engine_config("m") == EngineConfig(ModelSpec("m"))
    for option in engine_options():
        expected = False if option.negated else option.default  # a --no- flag starts unset
        assert getattr(args, option.dest) == expected, option.name


def test_every_flag_has_help_and_appears_in_help():
    parser = build_parser()
    text = parser.format_help()  # also fails on a stray % in a help string
    for action in parser._actions:
        assert action.help and action.help.strip(), action.option_strings
        for flag in action.option_strings:
            assert flag in text
    assert all(option.help.strip() for option in engine_options())


def test_serve_flags_and_llm_options_build_the_same_config():
    values = {option.name: other_value(option) for option in engine_options()}
    argv = [arg for option in engine_options() for arg in as_argv(option, values[option.name])]
    from_flags = engine_config(build_parser().parse_args(argv), "m")
    assert from_flags == llm_engine_config("m", **values)
    assert from_flags == engine_config_from_options("m", **values)
    for option in engine_options():  # each flag lands in its own field
        assert read_back(from_flags, option) == values[option.name], option.name
    unchanged = [o.name for o in engine_options() if values[o.name] == o.default]
    assert unchanged == list(VALUES), "every option but the pinned ones moved off its default"


def test_flag_names_and_namespace_attributes_are_kept():
    args = build_parser().parse_args(["--num-kv-blocks", "8", "--no-prefix-caching", "--dp",
                                      "2", "--ep", "--accelerator", "cpu"])
    assert (args.num_kv_blocks, args.no_prefix_caching, args.dp, args.ep) == (8, True, 2, True)
    config = engine_config(args, "m")
    assert config.cache.num_blocks == 8 and not config.cache.enable_prefix_caching
    assert config.parallel.dp == 2 and config.parallel.ep and config.accelerator == "cpu"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--dtype", "fp64"])


def test_unknown_llm_option_is_a_type_error_listing_the_valid_ones():
    with pytest.raises(TypeError, match="'num_kv_blocks'") as info:
        LLM("/no/such/model", num_kv_blocks=8)  # refused before the model is looked at
    for name in ("num_blocks", "hicache_size_gb", "load_tokenizer"):
        assert name in str(info.value)
    with pytest.raises(TypeError, match="'path'"):
        engine_config_from_options("m", path="x")  # internal fields are not options


def test_llm_refuses_data_parallel_before_loading():
    with pytest.raises(ValueError, match="deepinfer-serve --dp"):
        LLM("/no/such/model", dp=2)
    with pytest.raises(ValueError, match="block_size"):
        LLM("/no/such/model", block_size=0)  # the dataclasses' checks run first too


def test_docs_name_every_flag_and_option():
    with open(DOCS, encoding="utf-8") as f:
        docs = f.read()
    for option in engine_options():
        assert f"`{option.flag}`" in docs, option.flag
        assert f"`{option.name}`" in docs, option.name


@pytest.mark.parametrize("flags, message", [
    (["--dp", "2", "--eplb-redundant-experts", "3"], "8 experts + 3 must divide by the 2 ranks"),
    (["--eplb-interval", "5"], "needs several ranks"),
    (["--dp", "2", "--no-ep", "--eplb-after-prefill"], "needs several ranks"),
    (["--dp", "2", "--eplb-interval", "5", "--model", "DENSE"], "has no experts"),
])
def test_eplb_flags_that_cannot_work_are_one_line_errors(tmp_path, capsys, flags, message):
    from deepinfer.serve.cli import main
    from tests.checkpoints import make_checkpoint

    moe = make_checkpoint(str(tmp_path / "moe"), "qwen3_moe")  # 8 experts
    dense = make_checkpoint(str(tmp_path / "dense"), "llama")
    flags = [dense if f == "DENSE" else f for f in flags]
    argv = ["--port", "0", "--accelerator", "cpu", *flags]
    if "--model" not in flags:
        argv += ["--model", moe]
    capsys.readouterr()  # drop the checkpoint writer's progress bar
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("deepinfer-serve: error:") and message in err and "\n" not in err


@pytest.mark.parametrize("accelerator,message", [
    ("tpu", "unknown accelerator 'tpu'"),
    ("nvidia", "accelerator 'nvidia'"),  # not available (or failing to load) without a GPU
])
def test_an_accelerator_that_cannot_serve_is_a_one_line_error(capsys, accelerator, message):
    """Probed in a short-lived process before anything starts (the API process stays free of
    torch): the selection's error, one line, exit status 2."""
    import torch

    if accelerator == "nvidia" and torch.cuda.is_available():
        pytest.skip("a GPU is here: nvidia can serve")
    from deepinfer.serve.cli import main

    assert main(["--port", "0", "--accelerator", accelerator]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("deepinfer-serve: error:") and message in err and "\n" not in err


def test_the_api_key_comes_from_a_file_and_a_typed_key_is_warned_about(tmp_path, caplog):
    from deepinfer.serve.preflight import PreflightError, api_key

    parser = build_parser()
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\nignored\n")
    argv = ["--api-key-file", str(key_file)]
    assert api_key(parser.parse_args(argv), argv) == "s3cret"
    with pytest.raises(PreflightError, match="not both"):
        argv = ["--api-key", "x", "--api-key-file", str(key_file)]
        api_key(parser.parse_args(argv), argv)
    key_file.write_text("\n")
    with pytest.raises(PreflightError, match="the first line is empty"):
        api_key(parser.parse_args(["--api-key-file", str(key_file)]), [])
    with caplog.at_level("WARNING"):
        assert api_key(parser.parse_args(["--api-key", "typed"]), ["--api-key", "typed"]) == \
            "typed"
    assert "visible to other users of this machine" in caplog.text
