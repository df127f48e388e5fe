# SPDX-License-Identifier: Apache-2.0
"""What the start-up memory profile reserves for the largest sampled tree
verify step, at Gemma 4's vocabulary (262,144), with and without gathering
the accepted path's logits on a step where no request asks for logprobs.

The tree walk gathers the path's rows of the processed logits only for
logprobs; the stack once gathered them on every step (`--gather-always`
restores that, for the comparison). A tiny Gemma 4 pair with that vocabulary
runs the profile's tree verify (`GPUModelRunner._dummy_tree_verify_run`, the
step the KV cache is sized around) on CPU; the peak is the most bytes of
tensors created during that call that are alive at once (torch dispatch
sees each). Counted in bytes, not timed: one run gives it.

    python tests/benchmarks/verify_memory.py [--max-num-seqs 4] [--gather-always]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"

GEMMA4_VOCAB_SIZE = 262_144
NUM_TREE_NODES = 12  # K=3, W=4


def peak_bytes(fn) -> int:
    """Most bytes of tensor storage created while `fn` runs and alive at
    once (storages created before it are not counted)."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = self.peak = 0
            self.storages: set[int] = set()

        def _freed(self, data_ptr: int, nbytes: int) -> None:
            self.live -= nbytes
            self.storages.discard(data_ptr)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in tree_flatten(out)[0]:
                if not isinstance(tensor, torch.Tensor):
                    continue
                storage = tensor.untyped_storage()
                data_ptr, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and data_ptr not in self.storages:
                    self.storages.add(data_ptr)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, data_ptr, nbytes)
            return out

    tracker = LiveBytes()
    with tracker:
        fn()
    return tracker.peak


def gather_path_logits_always() -> None:
    """The earlier walk: the path's logits gathered on every step."""
    from vllm.v1.worker.gpu.spec_decode.tree import rejection_sampler

    gumbel_sample, tree_walk = rejection_sampler.gumbel_sample, rejection_sampler.tree_walk
    processed = []
    kept = []

    def keep_logits(logits, *args, **kwargs):
        processed[:] = [logits]
        return gumbel_sample(logits, *args, **kwargs)

    def walk_and_gather(*args, **kwargs):
        result = tree_walk(*args, **kwargs)
        path_rows = result[3]
        kept.append(processed[0][path_rows])
        return result

    rejection_sampler.gumbel_sample = keep_logits
    rejection_sampler.tree_walk = walk_and_gather


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--gather-always", action="store_true",
                        help="gather the path's logits on every step (the earlier walk)")
    args = parser.parse_args()

    from tests.engine.model_runner_v2 import install

    install()
    from tests.engine.conftest import make_llm, shutdown
    from tests.engine.tiny_gemma4 import TinyGemma4Spec, build_tiny_pair

    target, assistant = build_tiny_pair(
        ROOT / "build" / "fixtures", TinyGemma4Spec(vocab_size=GEMMA4_VOCAB_SIZE))
    if args.gather_always:
        gather_path_logits_always()
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    peaks = []
    verify_run = GPUModelRunner._dummy_tree_verify_run

    def measured(self, hidden_states):
        peaks.append(peak_bytes(lambda: verify_run(self, hidden_states)))

    GPUModelRunner._dummy_tree_verify_run = measured
    llm = make_llm(target, {"method": "mtp", "model": str(assistant),
                            "num_speculative_tokens": 3, "tree_width": 4},
                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048,
                   kv_cache_memory_bytes=64 << 20)
    try:
        llm.collective_rpc(lambda worker: worker.model_runner.profile_run())
        vocab_size = llm.llm_engine.model_config.get_vocab_size()
    finally:
        shutdown(llm)
    rows = args.max_num_seqs * (1 + NUM_TREE_NODES)
    print("RESULT " + json.dumps({
        "gather_always": args.gather_always,
        "rows": rows,
        "vocab_size": vocab_size,
        "peak_bytes": peaks[-1],
        "logits_bytes": rows * vocab_size * 4,
    }))


if __name__ == "__main__":
    main()
