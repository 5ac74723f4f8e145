"""The module named by this package's "deepinfer" entry point. Keep it cheap to import: it is
loaded on every start-up and by `deepinfer plugins`, and the backend class is imported only when
DeepInfer probes or selects it."""
from __future__ import annotations

from deepinfer import hookimpl
from deepinfer.core.plugins import AcceleratorInfo


def _load():
    from deepinfer_example_plugin.accelerator import CountingAccelerator

    return CountingAccelerator


@hookimpl
def deepinfer_register_accelerators() -> list[AcceleratorInfo]:
    return [AcceleratorInfo(
        name="example", aliases=("counting",),
        # Below cpu (0), so probing never picks it: DEEPINFER_ACCELERATOR=example selects it.
        priority=-10, load=_load,
        description="example plugin: the torch runner over reference CPU ops, counting steps",
    )]
