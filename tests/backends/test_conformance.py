"""The CPU backend passes the conformance suite that plugin authors run on theirs."""
from deepinfer.backends.cpu.accelerator import CPUAccelerator
from deepinfer.core.testing import AcceleratorConformance, run_conformance


class TestCPUConformance(AcceleratorConformance):
    accelerator_cls = CPUAccelerator


def test_run_conformance_function(tmp_path):
    run_conformance(CPUAccelerator, str(tmp_path))
