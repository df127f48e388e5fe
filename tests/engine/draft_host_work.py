# SPDX-License-Identifier: Apache-2.0
"""What the host does in one tree draft step (`propose`), outside a replayed
CUDA graph: the tensors it allocates and the tensors it builds from host data.

- **Allocated**: every aten op whose output owns storage that none of its
  inputs owns (views, in-place and `out=` ops allocate nothing), counted
  through a TorchDispatchMode; factory calls (`torch.empty`, `torch.full`,
  ...) included.
- **Built from host data**: `torch.tensor`, `torch.as_tensor` and
  `torch.from_numpy`. Inside a CUDA graph such a tensor would be a constant
  of the capture; outside it, a copy from pageable host memory.

On CPU every tensor lives on the host, so an allocation counts whatever its
device. Work inside Triton's interpreter (which stands in for a GPU's kernel
launch) and inside `run_fullgraph` (a graph replay, which allocates from the
graph's pool at capture, not at replay) is not counted.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

INTERPRETER_FRAMES = ("triton/runtime/interpreter.py", "triton/language/")
HOST_DATA_BUILDERS = ("tensor", "as_tensor", "from_numpy")


def _in_interpreter() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename.replace("\\", "/")
        if any(part in filename for part in INTERPRETER_FRAMES):
            return True
        frame = frame.f_back
    return False


def _storages(tree) -> set[int]:
    out = set()
    for value in torch.utils._pytree.tree_leaves(tree):
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            with contextlib.suppress(RuntimeError):
                out.add(value.untyped_storage().data_ptr())
    return out


@dataclass
class StepWork:
    allocated: Counter = field(default_factory=Counter)
    host_built: Counter = field(default_factory=Counter)
    replays: int = 0


class _Allocations(TorchDispatchMode):
    def __init__(self, work: HostWork):
        super().__init__()
        self.work = work

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        step = self.work.current
        if step is not None and not self.work.paused and not _in_interpreter():
            fresh = _storages(out) - _storages((args, kwargs))
            if fresh:
                step.allocated[str(func.overloadpacket.__name__)] += len(fresh)
        return out


class HostWork:
    """Counts per draft step; `install(speculator, monkeypatch)` wraps its
    propose() and every graph replay (`CudaGraphManager.run_fullgraph`)."""

    def __init__(self) -> None:
        self.steps: list[StepWork] = []
        self.current: StepWork | None = None
        self.paused = False

    def install(self, speculator, monkeypatch) -> None:
        propose = speculator.propose
        work = self

        def counted_propose(*args, **kwargs):
            step = StepWork()
            work.current, work.paused = step, False
            try:
                with _Allocations(work):
                    return propose(*args, **kwargs)
            finally:
                work.current = None
                if not kwargs.get("dummy_run", False):
                    work.steps.append(step)

        monkeypatch.setattr(speculator, "propose", counted_propose)
        for name in HOST_DATA_BUILDERS:
            monkeypatch.setattr(torch, name, self._counted_builder(getattr(torch, name), name))
        from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

        replay = CudaGraphManager.run_fullgraph

        def counted_replay(manager, desc):
            if work.current is not None:
                work.current.replays += 1
            paused, work.paused = work.paused, True
            try:
                return replay(manager, desc)
            finally:
                work.paused = paused

        monkeypatch.setattr(CudaGraphManager, "run_fullgraph", counted_replay)

    def _counted_builder(self, builder, name):
        def counted(*args, **kwargs):
            if self.current is not None and not self.paused and not _in_interpreter():
                self.current.host_built[name] += 1
            return builder(*args, **kwargs)

        return counted

    def summary(self, steps: list[StepWork] | None = None) -> dict:
        steps = self.steps if steps is None else steps
        if not steps:
            return {"steps": 0}
        allocated = [sum(s.allocated.values()) for s in steps]
        host_built = [sum(s.host_built.values()) for s in steps]
        return {
            "steps": len(steps),
            "replayed_steps": sum(1 for s in steps if s.replays),
            "allocated_per_step": [min(allocated), max(allocated)],
            "host_built_per_step": [min(host_built), max(host_built)],
            "allocated_ops": dict(sum((s.allocated for s in steps), Counter())),
            "host_built_calls": dict(sum((s.host_built for s in steps), Counter())),
        }
