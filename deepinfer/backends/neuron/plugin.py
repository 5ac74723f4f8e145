"""The Neuron backend's plugin module (entry point `neuron`). Probed only when a Neuron runtime
is installed (TorchNeuron or torch-neuronx) or DEEPINFER_NEURON_DEVICE=cpu asks for the host."""
from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.backends.neuron.env import plugin_rank_env
from deepinfer.core.plugins import AcceleratorInfo, hookimpl

if TYPE_CHECKING:
    from deepinfer.core.accelerator import Accelerator


def _load_neuron() -> type["Accelerator"]:
    from deepinfer.backends.neuron.accelerator import NeuronAccelerator

    return NeuronAccelerator


def _unavailable() -> str | None:
    from deepinfer.backends.neuron import device

    return None if device.available() else device.unavailable_reason()


@hookimpl
def deepinfer_register_accelerators() -> list[AcceleratorInfo]:
    return [AcceleratorInfo(
        name="neuron", aliases=("trainium", "trn"), priority=20, load=_load_neuron,
        probe=_unavailable,
        rank_env=plugin_rank_env,  # each rank its own NeuronCores, before the runtime loads
        description="AWS Trainium: static shapes, fixed KV pool, static MoE (TorchNeuron; "
                    "DEEPINFER_NEURON_DEVICE=cpu runs its graphs on the host)",
    )]
