# SPDX-License-Identifier: Apache-2.0
"""Replays a `sitecustomize.py` trace of adaptive tree sizing (a benchmark
tool, not a test): rebuilds the start-up profile's table from the trace's
profile steps, feeds the served steps' timings to a fresh `TreeSizeChooser`
as the server did, and prints, at every timed step of a tree size, what the
table then predicts at REQUESTS requests: no drafts, the spine's 3 nodes,
their ratio and the scales (acceptance is not in the trace: the table
only).

    python tests/benchmarks/tree_size_trace/replay.py TRACE.jsonl \
        [--requests 16] [--depth 3] [--tree-width 4]
"""

import argparse
import json

import numpy as np

from vllm.config.speculative import leaf_sibling_token_tree
from vllm.v1.spec_decode.tree import NestedTokenTrees, SpecTokenTree
from vllm.v1.spec_decode.tree_sizing import TreeSizeChooser


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--tree-width", type=int, default=4)
    args = parser.parse_args()
    with open(args.trace) as f:
        records = [json.loads(line) for line in f if line.strip()]
    tree = leaf_sibling_token_tree(args.depth, args.tree_width)
    chooser = TreeSizeChooser(NestedTokenTrees(SpecTokenTree(tree)), 256)
    # The profile's steps run back to back; serving starts after a pause.
    served = next(i for i in range(1, len(records))
                  if records[i]["t"] - records[i - 1]["t"] > 5)
    for record in records[:served]:
        if "dt" in record:
            chooser.observe_step(record["dt"], record["tB"], record["tn"])
    chooser.finish_profile()
    print(chooser.format_table())
    columns = {int(n): c for c, n in enumerate(chooser.node_counts)}
    for i, record in enumerate(records[served:], served):
        # The server times the last step before it chooses this one's size.
        timed = "dt" in record
        if timed:
            predicted = chooser.step_seconds(record["tB"])[columns[record["tn"]]]
            chooser.observe_step(record["dt"], record["tB"], record["tn"])
        if "switch" in record:
            chooser.current = record["switch"]["to"]
        if not timed or record["tn"] == 0:
            continue
        seconds = chooser.step_seconds(args.requests)
        print(f"{i} B{record['tB']} n{record['tn']} {1000 * record['dt']:.1f} ms "
              f"(predicted {1000 * predicted:.1f}) | at {args.requests}: no drafts "
              f"{1000 * seconds[0]:.2f} ms, 3 nodes {1000 * seconds[3]:.2f} ms, "
              f"ratio {seconds[3] / seconds[0]:.2f}; columns "
              f"{np.round(chooser.column_scales, 3).tolist()}, rows "
              f"{np.round(chooser.row_scales, 3).tolist()}")


if __name__ == "__main__":
    main()
