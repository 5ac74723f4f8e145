"""A checkpoint's recommended sampling settings (generation_config.json), used as the defaults
of requests that leave them unset, as vLLM does with `--generation-config auto`."""
from __future__ import annotations

import json
import logging
import math
import os

log = logging.getLogger("deepinfer.serve")
# generation_config.json key -> request field; other keys (lengths, token ids) are not sampling
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "min_p": "min_p", "repetition_penalty": "repetition_penalty"}


def load_sampling_defaults(model_dir: str) -> dict[str, float | int]:
    """The sampling fields generation_config.json sets; {} when there is none. A value that
    is not a finite number is skipped with a warning, so a broken file never breaks serving."""
    path = os.path.join(model_dir, "generation_config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return {}
    out: dict[str, float | int] = {}
    for key, field in SAMPLING_KEYS.items():
        value = config.get(key) if isinstance(config, dict) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            log.warning("ignoring %s=%r in %s", key, value, path)
            continue
        out[field] = int(value) if key == "top_k" else float(value)
    return out
