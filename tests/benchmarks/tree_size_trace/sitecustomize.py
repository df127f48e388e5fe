# SPDX-License-Identifier: Apache-2.0
"""Traces adaptive tree sizing inside `vllm serve` (a benchmark tool, not a
test): one JSON line per scheduled step with its inputs to
`TreeSizeChooser.step` and the node count chosen, the timed duration of the
step before it, and the predicted table at every change of size.

    PYTHONPATH=tests/benchmarks/tree_size_trace TREE_SIZE_TRACE=/some/dir/name \
        vllm serve ...   # writes /some/dir/name.<pid>.jsonl per process

Fields: t (the step's start, perf_counter seconds), B (requests), v (nodes
verified), d (decodes only), n (nodes drafted), us (microseconds the
chooser's step took, in the scheduler); dt, tB, tn (the last step's
timed seconds, requests and node count, when it was timed); switch (from, to,
and per candidate node count E[L], predicted ms, predicted tokens/s, the row
and column scales, the columns' timed steps and lent shares). `replay.py`
rebuilds the table from a trace.
"""

import atexit
import importlib.abc
import importlib.util
import json
import os
import sys
import time

_PATH = os.environ.get("TREE_SIZE_TRACE")
_MODULE = "vllm.v1.spec_decode.tree_sizing"


def _install(tree_sizing) -> None:
    chooser_class = tree_sizing.TreeSizeChooser
    out = open(f"{_PATH}.{os.getpid()}.jsonl", "a", buffering=1 << 16)  # noqa: SIM115
    atexit.register(out.close)
    step = chooser_class.step

    def traced_step(self, now, batch_size, verified_num_nodes, decodes_only):
        last = self._last_step
        before = self.current
        started = time.perf_counter()
        num_nodes = step(self, now, batch_size, verified_num_nodes, decodes_only)
        record = {"t": now, "B": batch_size, "v": verified_num_nodes,
                  "d": decodes_only, "n": num_nodes,
                  "us": round(1e6 * (time.perf_counter() - started), 1)}
        if last is not None:
            record.update(dt=now - last[0], tB=last[1], tn=last[2])
        if self.current != before and self.seconds is not None:
            expected, seconds, rates = self.predicted_rates(batch_size)
            record["switch"] = {
                "from": before, "to": self.current,
                "E": expected.round(3).tolist(),
                "ms": (1000 * seconds).round(3).tolist(),
                "rate": rates.round(1).tolist(),
                "rows": self.row_scales.round(3).tolist(),
                "cols": self.column_scales.round(3).tolist(),
                "visits": self.column_corrections.tolist(),
                "lent": [round(x, 3) for x in self._lent_shares()],
            }
        out.write(json.dumps(record) + "\n")
        return num_nodes

    chooser_class.step = traced_step


class _Finder(importlib.abc.MetaPathFinder):
    """Patches the chooser once its module is imported, wherever from."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_install(module):
            exec_module(module)
            _install(module)

        spec.loader.exec_module = exec_and_install
        return spec


if _PATH:
    sys.meta_path.insert(0, _Finder())
