"""The one thin adapter between the Neuron backend and what executes its graphs.

Everything device-specific lives here; the rest of the backend (buckets, the fixed KV pool,
static attention, static MoE, region timing) is plain torch over static shapes and runs the same
on every adapter:

- `neuron`: TorchNeuron, the native `neuron` torch device (trn2 and later); graphs through
  `torch.compile(backend="neuron")`, collectives through torch.distributed's `neuron` backend.
- `xla`: PyTorch/XLA's lazy tensors (torch-neuronx on older instances; anywhere, PyTorch/XLA's
  CPU PJRT device, PJRT_DEVICE=CPU): a step's ops are traced and cut into one graph at
  `end_step`, and XLA compiles a graph once per distinct trace (one per bucket), then replays
  it; the `xla` process-group backend.
- `cpu`: the backend's own static graphs executed eagerly on the host (gloo for collectives),
  so that everything but the chip and its compiler runs anywhere; the static-shape guard
  (buckets.py) then stands in for the compiler's refusal of a shape it was not built for.

DEEPINFER_NEURON_DEVICE picks one (default `auto`: TorchNeuron if present, else torch-neuronx;
`xla` asked for by name needs PyTorch/XLA only).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from deepinfer.backends.neuron.env import neuron_settings, use_compile_cache

DEVICE_ENV = "DEEPINFER_NEURON_DEVICE"


class NeuronUnavailable(RuntimeError):
    """The selected Neuron device cannot run here."""


@dataclass(frozen=True)
class NeuronDevice:
    """What the backend needs of a device: where tensors live, how a step function becomes a
    compiled graph, the process-group backend, and how to wait for the device."""

    kind: str
    torch_device: torch.device
    distributed_backend: str

    def compile(self, fn: Callable, name: str) -> Callable:
        """fn as the device runs it: compiled once per input shape by TorchNeuron; as is on
        the host and on XLA, whose lazy tensors trace it (end_step cuts the graph). `name`
        labels the graph (compiler cache and logs)."""
        if self.kind != "neuron":
            return fn
        # dynamic=False: every bucket is its own graph, never a shape-polymorphic one.
        return torch.compile(fn, backend="neuron", dynamic=False)

    def inference(self) -> contextlib.AbstractContextManager:
        """The no-autograd mode of a step: PyTorch/XLA's functionalized tensors cannot be
        inference tensors, so XLA takes plain no_grad."""
        return torch.no_grad() if self.kind == "xla" else torch.inference_mode()

    def end_step(self) -> None:
        """After a step's forward: on XLA, cut the traced ops (the KV writes included) into
        one graph and launch it, so that no step's trace carries into the next."""
        if self.kind == "xla":
            importlib.import_module("torch_xla").sync()

    def synchronize(self) -> None:
        """Wait for the device to finish what it was given (region timing)."""
        if self.kind == "neuron":
            torch.neuron.synchronize()  # type: ignore[attr-defined]
        elif self.kind == "xla":
            importlib.import_module("torch_xla").sync(wait=True)


def _has_torch_neuron() -> bool:
    neuron = getattr(torch, "neuron", None)
    return neuron is not None and bool(getattr(neuron, "is_available", lambda: False)())


def _has_torch_neuronx() -> bool:
    return importlib.util.find_spec("torch_neuronx") is not None


def _has_torch_xla() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def requested_kind(environ: Mapping[str, str] | None = None) -> str:
    return neuron_settings(environ).device


def available(environ: Mapping[str, str] | None = None) -> bool:
    """Cheap probe (nothing is imported): a Neuron runtime is installed, or the host device
    was asked for."""
    kind = requested_kind(environ)
    if kind == "cpu":
        return True
    if kind == "neuron":
        return _has_torch_neuron()
    if kind == "xla":
        return _has_torch_xla()
    return _has_torch_neuron() or _has_torch_neuronx()


def unavailable_reason(environ: Mapping[str, str] | None = None) -> str:
    kind = requested_kind(environ)
    wanted = {"neuron": "TorchNeuron (torch.neuron) is not importable or sees no NeuronCore",
              "xla": "PyTorch/XLA (torch-xla) is not installed"}.get(
        kind, "neither TorchNeuron (torch.neuron) nor torch-neuronx is installed")
    return (f"{wanted} ({DEVICE_ENV}={kind}): on a Trainium host "
            "install the Neuron SDK's torch-neuronx or TorchNeuron (Neuron docs, \"Setup\"); "
            f"anywhere, {DEVICE_ENV}=cpu runs the backend's static graphs on the CPU, and "
            f"{DEVICE_ENV}=xla with PJRT_DEVICE=CPU traces and compiles them on PyTorch/XLA's "
            "CPU device (scripts/xla_env.sh installs it)")


def select_device(environ: Mapping[str, str] | None = None) -> NeuronDevice:
    kind = requested_kind(environ)
    if kind == "auto":
        kind = "neuron" if _has_torch_neuron() else "xla" if _has_torch_neuronx() else ""
    if kind == "cpu":
        return NeuronDevice("cpu", torch.device("cpu"), "gloo")
    if kind == "neuron" and _has_torch_neuron():
        return NeuronDevice("neuron", torch.device("neuron"), "neuron")
    if kind == "xla" and _has_torch_xla():
        use_compile_cache()  # before torch_xla is imported: it reads the flags then
        xla = importlib.import_module("torch_xla")
        return NeuronDevice("xla", xla.device(), "xla")
    raise NeuronUnavailable(f"no Neuron runtime here: {unavailable_reason(environ)}")
