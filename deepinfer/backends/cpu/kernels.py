"""The CPU backend's C++ kernels, built on first use: GGUF block-quantized matmuls
(gguf_kernels.cpp) and fused float32 decode ops (fused_ops.cpp).

The extension is compiled once per machine kind and torch version into the deepinfer cache dir
(AVX2 + F16C where the CPU has them, with AVX-512 VNNI where it has that too, portable C++
elsewhere); later starts load the build.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import time
from collections.abc import Iterator

import torch

from deepinfer.core.config import cache_dir

log = logging.getLogger(__name__)
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [os.path.join(_HERE, f) for f in ("bindings.cpp", "gguf_kernels.cpp",
                                             "gguf_kquants.cpp", "gguf_rows8.cpp",
                                             "fused_ops.cpp", "decode_layers.cpp")]
_HEADERS = ("gguf_blocks.h", "decode_layers.h", "native_ops.h")
# The GGUF block types the kernels run (models/quant kinds).
GGUF_KINDS = ("gguf:Q4_0", "gguf:Q4_1", "gguf:Q5_0", "gguf:Q5_1", "gguf:Q8_0", "gguf:Q2_K",
              "gguf:Q3_K", "gguf:Q4_K", "gguf:Q5_K", "gguf:Q6_K")
# The block types whose rows the batch-1 GEMV takes interleaved in groups of INTERLEAVE
# (gguf_rows8.cpp; GGML type numbers), where the extension is built with AVX2.
INTERLEAVED_TYPES = (2, 3, 6, 7, 8, 12)  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K
INTERLEAVE = 8
# Rows of x the integer-dot GEMV takes in one call (kMaxRows in the source); a step with more
# tokens takes it in chunks (below) or dequantizes the weight for one GEMM.
MAX_GEMV_ROWS = 16
# Up to this many rows the GEMV still beats one GEMM on the dequantized weight when it takes
# them in even chunks of at most MAX_GEMV_ROWS (each chunk reads the packed weight again;
# the GEMM writes and reads a bfloat16 copy): cpu_gguf_batch.py, two runs on a 2-core Zen 4
# with bfloat16 GEMMs, 24 sequences decoding 1.29-1.38x, 32 1.07-1.17x, 48 0.89-1.04x.
CHUNKED_GEMV_ROWS = 32


_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
# With these the batch-1 GEMV multiplies and adds in one instruction (256-bit vpdpwssd) and has
# 32 vector registers; torch's capability does not say whether the CPU has VNNI,
# /proc/cpuinfo does.
_AVX512_VNNI = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")


def _vector_flags() -> tuple[str, list[str]]:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512" and _cpu_flags().issuperset(_AVX512_VNNI):
        return "avx512vnni", [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
    if capability in ("AVX2", "AVX512"):
        return "avx2", _AVX2
    return "portable", []


def _cpu_flags() -> set[str]:
    """The flags /proc/cpuinfo lists for the first CPU (none where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _header_digest() -> str:
    """torch's load() rebuilds when a source changes, not a header: a header's change makes a
    build folder of its own."""
    digest = hashlib.sha1()
    for header in _HEADERS:
        with open(os.path.join(_HERE, header), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:10]


def interleaves(weight) -> bool:
    """Whether the batch-1 GEMV runs faster on this GGUF weight with its rows interleaved:
    its type has the kernel and the build has the vectors for it."""
    return weight.qtype in INTERLEAVED_TYPES and weight.shape[0] % INTERLEAVE == 0 and \
        _vector_flags()[0] != "portable"


@functools.lru_cache(maxsize=None)
def extension():
    """The compiled module (bindings.cpp lists its functions)."""
    from torch.utils.cpp_extension import load

    kind, flags = _vector_flags()
    build = os.path.join(cache_dir(), "extensions",
                         f"cpu_kernels3-torch{torch.__version__}-{kind}-{_header_digest()}")
    os.makedirs(build, exist_ok=True)
    fresh = not any(name.endswith(".so") for name in os.listdir(build))
    if fresh:
        log.info("building the CPU backend's C++ kernels once into %s (tens of seconds on "
                 "idle cores, minutes on busy ones; later starts load them)", build)
    start = time.monotonic()
    try:
        with build_lock(build):
            # -fopenmp: ATen's parallel_for is OpenMP pragmas inlined into this code; without
            # the flag they compile away and every kernel runs on one thread.
            module = load(name="deepinfer_cpu_kernels3", sources=_SOURCES, build_directory=build,
                          extra_cflags=["-O3", "-fopenmp", *flags], extra_ldflags=["-fopenmp"])
    except (OSError, RuntimeError) as exc:
        raise RuntimeError(f"could not build the CPU backend's kernels ({exc}); they need a C++ "
                           f"compiler and ninja. --quantization none serves the dequantized "
                           f"weights instead") from exc
    if fresh:
        log.info("built the CPU backend's C++ kernels in %.0f s", time.monotonic() - start)
    return module


@contextlib.contextmanager
def build_lock(build: str) -> Iterator[None]:
    """One process at a time builds or loads into `build`, under a lock the kernel drops when
    its holder dies. torch's own lock is a file that a killed build leaves behind, and every
    later start would wait on it forever: under this lock, such a file is stale."""
    with open(os.path.join(build, "deepinfer-build.lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            stale = os.path.join(build, "lock")  # torch.utils.cpp_extension's FileBaton
            if os.path.exists(stale):
                log.warning("removing %s, left by a build that was stopped", stale)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def fusable(kernels, *tensors: torch.Tensor) -> bool:
    """Whether the C++ kernels (None where they did not build) take these tensors: float32
    and contiguous. A plain loop, not all() over a generator: at batch 1 this runs several
    times a layer."""
    if kernels is None:
        return False
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_contiguous():
            return False
    return True


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int, in_features: int,
                bf16: bool = False, interleaved: bool = False) -> torch.Tensor:
    """x [T, K] @ W.T for W [N, K] held as GGUF blocks [N, row_bytes] (rows interleaved by
    INTERLEAVE with `interleaved`); float32 out. Up to CHUNKED_GEMV_ROWS rows the GEMV, in even
    chunks of at most MAX_GEMV_ROWS; above, the weight is dequantized for one GEMM, in bfloat16
    with `bf16` (x rounded to bfloat16 too: as llama.cpp rounds x to 8 bits for its quantized
    dot products)."""
    ext = extension()
    x = x.float()
    if x.shape[0] <= MAX_GEMV_ROWS:
        return ext.gemv(x, blocks, qtype, interleaved)
    if x.shape[0] <= CHUNKED_GEMV_ROWS:  # even chunks: none of one row (batch 1's numerics)
        return torch.cat([ext.gemv(c, blocks, qtype, interleaved)
                          for c in x.tensor_split(-(-x.shape[0] // MAX_GEMV_ROWS))])
    if bf16:  # the weight expanded straight to bfloat16, never to a float32 copy
        w = ext.dequantize_bf16(blocks, qtype, in_features, interleaved)
        return torch.nn.functional.linear(x.bfloat16(), w).float()
    return torch.nn.functional.linear(x, ext.dequantize(blocks, qtype, in_features, interleaved))


def native_bf16_gemm() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX): there a prefill's
    GEMMs run ~3x faster in bfloat16 than in float32 (a SmolLM2 layer's four on a 2-core Zen 4
    VM: 5.5 against 15.9 ms); elsewhere oneDNN emulates it, slower than float32."""
    return not _cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


def gguf_dequantize(blocks: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """GGUF blocks [N, row_bytes] -> float32 [N, K]."""
    return extension().dequantize(blocks.contiguous(), qtype, in_features)
