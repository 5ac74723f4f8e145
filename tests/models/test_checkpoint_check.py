"""A broken checkpoint is one line before any rank starts (models/checkpoint_check.py), and
a rank that fails to start anyway is one line too."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from deepinfer.models.checkpoint_check import CheckpointError, check_gguf, check_hf_folder
from tests.checkpoints import copy_default_tokenizer, make_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("good")), "llama")


def _copy(good: str, tmp_path) -> str:
    folder = str(tmp_path / "ckpt")
    shutil.copytree(good, folder)
    return folder


def _edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


def test_a_good_checkpoint_passes(good):
    check_hf_folder(good)


@pytest.mark.parametrize("breakage, message", [
    ("json", "config.json is not valid JSON: Extra data: line"),
    ("field-type", "does not describe a model DeepInfer can build: "),
    ("architecture", "unsupported architecture 'GPT9ForCausalLM'"),
    ("truncated", "is not a readable safetensors file (truncated or corrupt?)"),
    ("no-weights", "has no *.safetensors weight files"),
])
def test_a_broken_checkpoint_is_one_line(good, tmp_path, breakage, message):
    folder = _copy(good, tmp_path)
    weights = os.path.join(folder, "model.safetensors")
    if breakage == "json":
        with open(os.path.join(folder, "config.json"), "a") as f:
            f.write("{")
    elif breakage == "field-type":
        _edit_config(folder, hidden_size="big")
    elif breakage == "architecture":
        _edit_config(folder, architectures=["GPT9ForCausalLM"])
    elif breakage == "truncated":
        os.truncate(weights, os.path.getsize(weights) // 2)
    else:
        os.remove(weights)
    with pytest.raises(CheckpointError) as info:
        check_hf_folder(folder)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_dummy_weights_need_only_the_config(good, tmp_path):
    folder = _copy(good, tmp_path)
    os.remove(os.path.join(folder, "model.safetensors"))
    check_hf_folder(folder, read_weights=False)


def test_a_truncated_gguf_is_one_line(tmp_path):
    import gguf
    import numpy as np

    path = str(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight", np.ones((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    check_gguf(path)
    os.truncate(path, os.path.getsize(path) - 1024)
    with pytest.raises(CheckpointError, match="is not a readable GGUF file"):
        check_gguf(path)


def test_serve_refuses_a_broken_checkpoint_in_one_line(good, tmp_path, capsys):
    """Through deepinfer-serve's preflight (the probe process): no rank is started."""
    from deepinfer.serve.cli import main

    folder = _copy(good, tmp_path)
    _edit_config(folder, num_hidden_layers="two")
    assert main(["--port", "0", "--accelerator", "cpu", "--model", folder]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"deepinfer-serve: error: --model {folder}/config.json does not "
                          "describe a model") and "\n" not in err


def test_serve_refuses_a_host_cache_beyond_memory(good, capsys):
    from deepinfer.serve.cli import main

    assert main(["--port", "0", "--model", good, "--hicache-size-gb", "100000"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--hicache-size-gb 100000 x 1 rank(s) needs 100000 GiB" in err and "\n" not in err


def test_a_rank_that_cannot_load_is_one_line(good, tmp_path, capsys):
    """Headers whole, config fine, but a weight of the wrong shape: the rank fails while
    loading, and the server says why in one line (exit status 1, no traceback)."""
    from deepinfer.serve.cli import main

    folder = copy_default_tokenizer(_copy(good, tmp_path))  # a server needs one too
    weights = os.path.join(folder, "model.safetensors")
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10].clone()
    save_file(tensors, weights, metadata={"format": "pt"})
    assert main(["--port", "0", "--accelerator", "cpu", "--model", folder]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("deepinfer-serve: error: engine rank 0 failed to start: ")
    assert "model.norm.weight" in err[-1] and not any("Traceback" in line for line in err)
