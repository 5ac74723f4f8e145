"""Triton kernels run under the interpreter on CPU tensors when there is no GPU.

The variable must be set before any kernel module is imported (triton.jit reads it when it
decorates), so it is set here, at conftest import time. Two interpreter bugs of Triton 3.6
that would fail correct kernels (and its float8 cast) are patched for the session, only where
present, and so are two slow paths: a redundant re-patch on every helper call, and the
element-by-element Python loop that reduces with xor (what tl.sort's bitonic network is made of).
"""
import os

import numpy as np
import pytest
import torch
from bf16_rounding import rtne_bf16

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")


def _numpy_refuses_size1_int() -> bool:
    try:
        int(np.zeros(1, dtype=np.int32))
    except TypeError:
        return True
    return False


def _patch_scalar_index(mp: pytest.MonkeyPatch, interpreter) -> None:
    """Scalars are shape-(1,) arrays and __index__ calls int() on them, which NumPy >= 2.4
    refuses (triton-lang/triton#9171): every loop over tensor bounds fails."""
    original = interpreter._patch_lang_tensor

    def patch(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    mp.setattr(interpreter, "_patch_lang_tensor", patch)


def _patch_bf16_dot(mp: pytest.MonkeyPatch, interpreter) -> None:
    """bf16 values are held as their uint16 bits and create_dot multiplies those bits as
    integers; widen bf16 operands to fp32 first (exact, as the tensor cores do)."""
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widen(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    mp.setattr(builder, "create_dot", create_dot)


def _patch_fp8_cast(mp: pytest.MonkeyPatch, interpreter) -> None:
    """float32 -> float8 casts truncate the mantissa and add the cut-off bit, OR-ing the carry
    into the exponent (-124 becomes -64, not -128) and rounding ties away from zero; cast like
    the GPU (and torch): round to nearest even."""
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    original = builder.create_fp_to_fp
    fp8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        dst = fp8.get(dst_type.scalar)
        if dst is None or src.dtype.scalar not in (tl.float32, tl.float16):
            return original(self, src, dst_type, rounding_mode)
        data = torch.from_numpy(np.ascontiguousarray(src.data)).to(dst).view(torch.uint8)
        return interpreter.TensorHandle(data.numpy(), dst_type.scalar)

    mp.setattr(builder, "create_fp_to_fp", create_fp_to_fp)


def _patch_device_calls(mp: pytest.MonkeyPatch, interpreter) -> None:
    """Each call of a @triton.jit helper inside a kernel re-patches triton.language (getmembers
    scans of tl, tl.tensor and tl.math: a quarter of an engine step's time under the
    interpreter), although the launch running it has patched those modules already and
    restores them when it ends. Skip the re-patch where the launch covers the helper's
    modules; the helper runs the same code either way."""
    import inspect

    import triton.language as tl

    patched: list[frozenset[int]] = []  # the modules of each launch in progress
    langs: dict[object, frozenset[int]] = {}

    def modules(fn) -> frozenset[int]:
        if fn not in langs:
            langs[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                  if inspect.ismodule(v) and v in (tl, tl.core))
        return langs[fn]

    launch = interpreter.GridExecutor.__call__
    device_call = interpreter.InterpretedFunction.__call__

    def grid_call(self, *args, **kwargs):
        patched.append(modules(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def helper_call(self, *args, **kwargs):
        if not patched or not modules(self.fn) <= patched[-1]:
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    mp.setattr(interpreter.GridExecutor, "__call__", grid_call)
    mp.setattr(interpreter.InterpretedFunction, "__call__", helper_call)


def _patch_xor_reduce(mp: pytest.MonkeyPatch, interpreter) -> None:
    """The interpreter reduces with NumPy where it knows the combine function (sum, min, max,
    argmin, argmax) and otherwise calls it once per element in Python; tl.sort xor-reduces at
    every stage of its network, ~2 s for a 1K-lane sort (fused_moe's align). Reduce xor with
    NumPy too: the same integers, in any order."""
    import triton.language as tl

    reduce_ops = interpreter.ReduceOps
    original = reduce_ops.apply_impl

    def apply_impl(self, input):
        if self.combine_fn is not tl.standard._xor_combine:
            return original(self, input)
        out = np.bitwise_xor.reduce(input[0].handle.data, axis=self.axis,
                                    keepdims=self.keep_dims)
        return self.to_tensor(out, input[0].dtype)

    mp.setattr(reduce_ops, "apply_impl", apply_impl)


@pytest.fixture(autouse=True, scope="session")
def _interpreter_fixes():
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from triton.runtime import interpreter

    with pytest.MonkeyPatch.context() as mp:
        if _numpy_refuses_size1_int():
            _patch_scalar_index(mp, interpreter)
        _patch_bf16_dot(mp, interpreter)
        _patch_fp8_cast(mp, interpreter)
        _patch_device_calls(mp, interpreter)
        _patch_xor_reduce(mp, interpreter)
        yield


@pytest.fixture(scope="module")
def gpu_bf16_rounding():
    """Triton's interpreter truncates float32 -> bfloat16 casts, while compiled Triton (and
    torch) round to nearest even; make the interpreter round like the GPU."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(rtne_bf16(src.data), dst_type.scalar)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl
    try:
        yield
    finally:
        builder.cast_impl = original
