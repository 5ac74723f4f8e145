"""What a folder converted from a GGUF holds, read without the converter (which needs torch):
the API process finds a converted model without loading torch."""
from __future__ import annotations

import os
from pathlib import Path

from deepinfer.core.config import cache_dir

# Written last inside the temp folder; its presence means the folder is complete.
MARKER_FILE = "deepinfer-conversion.json"
# The source file, kept in the folder: backends that run its quantized blocks natively load
# the weights from it (gguf_checkpoint.py) instead of the dequantized safetensors.
GGUF_FILE = "model.gguf"
# Where each planned tensor lies in it: reading that is instant, where GGUFReader parses every
# metadata field (the whole vocabulary) first.
GGUF_INDEX_FILE = "gguf_tensors.json"
FORMAT_VERSION = 1


def is_converted(out_dir: str) -> bool:
    return os.path.isfile(os.path.join(out_dir, MARKER_FILE))


def converted_dir(gguf_path: str) -> str:
    """Where convert_gguf puts a GGUF's conversion unless told otherwise."""
    return os.path.join(cache_dir(), "models", Path(gguf_path).stem)
