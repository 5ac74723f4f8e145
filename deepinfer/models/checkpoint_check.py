"""Is a model folder or file one we can load? Checked before any rank starts, so that a broken
checkpoint is one line for the user instead of a rank's traceback: config.json parses and
builds its family's model (on the meta device: nothing is allocated), and every safetensors
file's header is whole and covered by the file. A .gguf file's header and tensor table are read
the same way. No weight data is read."""
from __future__ import annotations

import glob
import json
import os


class CheckpointError(ValueError):
    """What is wrong with a checkpoint, in one line."""


def check_hf_folder(path: str, read_weights: bool = True) -> None:
    """config.json and (with `read_weights`) the safetensors headers of an HF folder."""
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_path}: {exc}") from exc
    _check_family(path)
    if read_weights:
        _check_safetensors(path)


def _check_family(path: str) -> None:
    import torch

    from deepinfer.models.hf_config import architecture, load_config
    from deepinfer.models.registry import model_class

    try:
        config = load_config(path)
        cls = model_class(architecture(config))
        with torch.device("meta"):
            cls(config, None, 1)
    except Exception as exc:  # noqa: BLE001 - transformers and the families raise many kinds
        raise CheckpointError(f"{path}/config.json does not describe a model DeepInfer can "
                              f"build: {_one_line(exc)}") from exc


def _check_safetensors(path: str) -> None:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weight files")
    for file in files:
        try:
            with safe_open(file, framework="numpy") as f:
                f.keys()
        except Exception as exc:  # noqa: BLE001 - safetensors' own error type
            raise CheckpointError(f"{file} is not a readable safetensors file (truncated or "
                                  f"corrupt?): {_one_line(exc)}") from exc


def check_gguf(path: str) -> None:
    """A .gguf file's header and tensor table, and that its tensor data fits in the file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - numpy and gguf raise many kinds on bad bytes
        raise CheckpointError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                              f"{_one_line(exc)}") from exc
    if not reader.tensors:
        raise CheckpointError(f"{path} holds no tensors")


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[:3]) or type(exc).__name__
