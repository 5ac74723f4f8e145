"""Programmatic dependent launch (PDL, Hopper and later) for the decode-path kernels.

A kernel launched with PDL may start before the kernel ahead of it on the stream has finished:
its programs are scheduled as soon as every program of the predecessor has exited or called
gdc_launch_dependents(). Each such kernel must call gdc_wait(), which returns once the
predecessor has completed and its writes are visible, before it touches any activation (read or
write). Only data no kernel writes, such as weights, may be read before the wait. Every program
waits unconditionally, so "completed" stays transitive down the stream.

The point at batch 1: a decode step is ~350 kernels, most of them a few microseconds long. With
PDL the GEMV after a norm starts streaming its weights while the norm still runs, and the launch
gap between kernels is hidden.

Off under the Triton interpreter, before Hopper, and with DEEPINFER_CUDA_PDL=0.
"""
from __future__ import annotations

import functools

import torch

from deepinfer.backends.cuda.settings import cuda_settings, interpreted


@functools.cache
def _device_supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    if device.type != "cuda" or interpreted():
        return False
    if not cuda_settings().pdl:
        return False
    return _device_supports_pdl(device.index if device.index is not None
                                else torch.cuda.current_device())


def launch_kwargs(device: torch.device) -> dict:
    """Keyword arguments of a kernel launch: PDL (the constexpr) and Triton's launch option."""
    if pdl_enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
