"""What a step did on PyTorch/XLA, from its debug metrics: graphs compiled, graphs executed,
transfers each way, ops that ran on the host. This is what decides on Trainium whether serving
replays the graphs built at start-up or stalls on the compiler and on host round trips.

A step's plan: its inputs go in (a transfer each), one graph runs (cut at the step's end), the
logits come out (one transfer, after the step). Anything else during the step is unplanned:
- a compilation after start-up: a trace that differs from every bucket's graph (a Python
  number traced as a constant, a shape that slipped past the buckets). The audit names the
  first op where the step's trace departs from the graph its bucket compiled at start-up.
- a second graph execution, a transfer out or a host-fallback op inside the step: a host sync
  that cuts the step in two (`.item()`, `int(t)`, `.cpu()`, data-dependent shapes such as
  `nonzero`). The audit names the ops from PyTorch/XLA's op counters.

DEEPINFER_NEURON_AUDIT_GRAPHS=1 turns it on (every step reads the metrics and traces its IR
text: for tests and bring-up, not for serving speed); a violation raises UnplannedGraphError.
"""
from __future__ import annotations

import importlib
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import torch

# Op counters that mean the host waited for the device mid-step: results read back, or an
# op PyTorch/XLA ran on the CPU (every `aten::` counter is such a fallback).
_SYNC_OPS = ("xla::_to_cpu", "xla::_local_scalar_dense")
# Trace leaves: what a graph reads, not what it computes.
_LEAVES = ("xla::device_data", "prim::Constant")


class UnplannedGraphError(RuntimeError):
    """A step compiled a new graph or synced with the host where the plan has none."""


@dataclass(frozen=True)
class XlaCounts:
    compiles: int
    executions: int
    to_device: int
    from_device: int
    ops: dict[str, int] = field(default_factory=dict)
    compile_seconds: float = 0.0

    def minus(self, before: "XlaCounts") -> "XlaCounts":
        ops = {k: v - before.ops.get(k, 0) for k, v in self.ops.items()
               if v != before.ops.get(k, 0)}
        return XlaCounts(self.compiles - before.compiles, self.executions - before.executions,
                         self.to_device - before.to_device,
                         self.from_device - before.from_device, ops,
                         self.compile_seconds - before.compile_seconds)

    def sync_ops(self) -> list[str]:
        """Ops among these counts that make the host wait for the device."""
        return sorted(op for op in self.ops if op.startswith("aten::") or op in _SYNC_OPS)


def _metrics():
    return importlib.import_module("torch_xla.debug.metrics")


def _samples(metrics, name: str) -> int:
    data = metrics.metric_data(name)
    return int(data[0]) if data else 0


def _total_seconds(metrics, name: str) -> float:
    data = metrics.metric_data(name)  # (samples, accumulated nanoseconds, recent samples)
    return data[1] / 1e9 if data else 0.0


def xla_counts() -> XlaCounts:
    """PyTorch/XLA's totals in this process so far."""
    met = _metrics()
    ops = {name: int(met.counter_value(name) or 0) for name in met.counter_names()
           if name.startswith(("aten::", "xla::"))}
    return XlaCounts(_samples(met, "CompileTime"), int(met.counter_value("ExecuteComputation")
                                                       or 0),
                     _samples(met, "TransferToDeviceTime"),
                     _samples(met, "TransferFromDeviceTime"), ops,
                     _total_seconds(met, "CompileTime"))


def hlo_instructions(tensors: Sequence[torch.Tensor]) -> int:
    """Instructions of the HLO module that computes `tensors` (pending, not yet synced): the
    size of what the device's compiler receives for it."""
    xlac = importlib.import_module("torch_xla")._XLAC
    text = xlac._get_xla_tensors_hlo(list(tensors))
    return sum(1 for line in text.splitlines() if " = " in line and not line.startswith("Hlo"))


def ir_text(tensors: Sequence[torch.Tensor]) -> list[str]:
    """The pending trace that computes `tensors`, one op a line, node numbers dropped (so two
    traces of the same graph compare equal)."""
    xlac = importlib.import_module("torch_xla")._XLAC
    text = xlac._get_xla_tensors_text(list(tensors))
    return [re.sub(r"%\d+", "%", line).strip() for line in text.splitlines()
            if "=" in line]


def first_difference(built: list[str], now: list[str]) -> str:
    """The ops `now` has that `built` lacks and the reverse, as multisets: the op kinds first,
    then the data and constants (a constant where the graph took data is a recompile too)."""
    added, dropped = Counter(now) - Counter(built), Counter(built) - Counter(now)

    def named(ops: Counter) -> list[str]:
        lines = sorted(ops, key=lambda line: any(k in line for k in _LEAVES))
        return [line.split("=", 1)[1].strip() for line in lines[:2]]

    parts = [f"adds {', '.join(named(added))}" if added else "",
             f"drops {', '.join(named(dropped))}" if dropped else ""]
    return "; ".join(p for p in parts if p) or "no op (the same trace compiled again)"


class GraphAudit:
    """Checks each step against the plan (see the module docstring). `record` the trace of
    every bucket while the graphs are built, then `check` each serving step."""

    def __init__(self) -> None:
        self.built: dict[tuple, list[str]] = {}
        self.steps = 0
        # Once a step broke the plan every later one fails too: a step run again (the
        # engine's fault isolation) replays the graph the first one compiled, and would pass.
        self.violations: list[str] = []

    def record(self, key: tuple, trace: list[str]) -> None:
        self.built[key] = trace

    def check(self, key: tuple, trace: list[str], delta: XlaCounts, inputs: int) -> None:
        """delta: the counts over the step from its inputs to its graph's launch (before the
        logits are read back): `inputs` transfers in, one execution, no compile, no transfer
        out, no host op."""
        self.steps += 1
        if self.violations:
            raise UnplannedGraphError(f"an earlier step broke the plan: {self.violations[0]}")
        problems = []
        if delta.to_device != inputs:
            problems.append(f"{delta.to_device} transfers to the device where the step has "
                            f"{inputs} inputs")
        if delta.compiles:
            built = self.built.get(key)
            where = first_difference(built, trace) if built is not None else \
                "no graph of this shape was built at start-up"
            problems.append(f"{delta.compiles} compilation(s) after start-up; against its "
                            f"bucket's graph the trace {where}")
        sync = delta.sync_ops()
        if sync or delta.from_device or delta.executions > 1:
            problems.append(f"a host sync inside the step: ops {', '.join(sync) or 'none'}, "
                            f"{delta.executions} graph executions, {delta.from_device} "
                            "transfers from the device")
        if problems:
            self.violations.append(f"{key[0]} step of bucket {key[1:]}: " + "; ".join(problems))
            raise UnplannedGraphError(self.violations[-1])
