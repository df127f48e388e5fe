# SPDX-License-Identifier: Apache-2.0
"""The Triton kernel specialisations an engine launches, as a GPU would
compile them: per launch, the kernel, its constexpr values, the dtypes of its
tensor arguments, the integer arguments it specialises on (Triton specialises
an integer that is not `do_not_specialize` by whether it is 1 and whether it
is a multiple of 16) and the launch options. Under Triton's interpreter
nothing compiles, so a specialisation first launched while serving is what a
GPU would have compiled on the serving path.

Run as a script (by test_kernel_specialisations.py, in a subprocess:
`--triton-attn` must select the backend before vLLM is imported), it starts a
Gemma 4 MTP tree engine as `vllm serve` starts one without --enforce-eager
(with its JIT warmup; no torch.compile or CUDA graphs on this CPU), serves
steps at every node count (or, with `--schedule`, at the schedule's), greedy
with logprobs and sampled, and prints one JSON line.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


class KernelSpecialisations:
    """Records each launch's specialisation key."""

    @contextmanager
    def recording(self) -> Iterator[Counter]:
        """Records the launches of this block: launches per key."""
        from triton.runtime import interpreter

        run = interpreter.InterpretedFunction.run
        launched: Counter = Counter()

        def recorded_run(kernel, *args, grid, warmup, **kwargs):
            launched[specialisation_key(kernel, args, kwargs)] += 1
            return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)

        interpreter.InterpretedFunction.run = recorded_run
        try:
            yield launched
        finally:
            interpreter.InterpretedFunction.run = run


def _is_constexpr(parameter: inspect.Parameter) -> bool:
    annotation = parameter.annotation
    if isinstance(annotation, str):
        return annotation.split(".")[-1] == "constexpr"
    return getattr(annotation, "__name__", None) == "constexpr"


def specialisation_key(kernel, args: tuple, kwargs: dict) -> tuple:
    import torch

    parameters = list(inspect.signature(kernel.fn).parameters.values())
    do_not_specialize = set(kernel.kwargs.get("do_not_specialize") or ())
    bound = dict(zip((p.name for p in parameters), args))
    bound.update({k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    fields = []
    for index, parameter in enumerate(parameters):
        if parameter.name not in bound:
            continue  # its default
        value = bound[parameter.name]
        if _is_constexpr(parameter):
            fields.append((parameter.name, repr(value)))
        elif isinstance(value, torch.Tensor):
            fields.append((parameter.name, str(value.dtype)))
        elif isinstance(value, bool) or value is None:
            fields.append((parameter.name, repr(value)))
        elif isinstance(value, int) and not (
            parameter.name in do_not_specialize or index in do_not_specialize
        ):
            fields.append((parameter.name, ("==1", value == 1, "%16", value % 16 == 0)))
    options = tuple((k, kwargs[k]) for k in LAUNCH_OPTIONS if k in kwargs)
    return (kernel.fn.__module__, kernel.fn.__qualname__, tuple(fields), options)


def describe(key: tuple) -> str:
    module, name, fields, options = key
    return f"{module}.{name}({', '.join(f'{n}={v}' for n, v in fields)}){options or ''}"


TREE_KERNELS = (
    "_tree_walk_kernel",
    "_prepare_tree_rows_kernel",
    "_commit_spec_tree_kv_kernel",
    "kernel_unified_attention",
)


def served_requests() -> list:
    from vllm import SamplingParams

    return [
        # Upstream's logprobs kernel is specialised by the logprobs count, with
        # or without trees; start-up warms 5.
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5),
        SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=4, ignore_eos=True),
    ]


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.engine.model_runner_v2 import install, select_triton_attention

    install()
    if "--triton-attn" in sys.argv:
        select_triton_attention()
    from tests.engine.conftest import make_llm, shutdown
    from tests.engine.trained_pair import text_prompts, trained_pair

    target, assistant = trained_pair()
    # --schedule: num_speculative_tokens_per_batch_size, whose node counts
    # (all with "auto") start-up warms; the steps serve those. Without one,
    # every node count.
    schedule = None
    if "--schedule" in sys.argv:
        schedule = json.loads(sys.argv[sys.argv.index("--schedule") + 1])
    recorder = KernelSpecialisations()
    with recorder.recording() as startup:
        llm = make_llm(
            target,
            {"method": "mtp", "model": str(assistant), "num_speculative_tokens": 3,
             "tree_width": 4, "num_speculative_tokens_per_batch_size": schedule},
            max_num_seqs=2,
            kv_cache_memory_bytes=64 << 20,
            enforce_eager=False,
            compilation_config={"mode": 0, "cudagraph_mode": "NONE"},
        )
    try:
        tree_sizes = llm.llm_engine.engine_core.engine_core.scheduler.tree_sizes
        node_counts = list(range(tree_sizes.nested.max_num_nodes + 1))
        if isinstance(schedule, list):
            node_counts = sorted({0, *(entry[2] for entry in schedule)})
        with recorder.recording() as serving:
            for num_nodes in node_counts:
                tree_sizes.pin(num_nodes)
                llm.generate(text_prompts(2, length=20), served_requests(), use_tqdm=False)
        drafts = sum(m.value for m in llm.get_metrics()
                     if m.name == "vllm:spec_decode_num_drafts")
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        backends = sorted({group.backend.get_name()
                           for groups in runner.attn_groups for group in groups})
        num_kv_cache_groups = len(runner.attn_groups)
    finally:
        shutdown(llm)
    launched = startup.keys() | serving.keys()
    # Launches of the attention kernel while serving, by its tree variant.
    attention = Counter()
    for key, count in serving.items():
        if key[1] == "kernel_unified_attention":
            use_tree = dict(key[2]).get("USE_TREE", "False") == "True"
            attention["tree" if use_tree else "plain"] += count
    print("RESULT " + json.dumps({
        "backends": backends,
        "node_counts": node_counts,
        "startup": len(startup),
        "serving": len(serving),
        "new_while_serving": [describe(key)
                              for key in sorted(serving.keys() - startup.keys())],
        "tree_kernels": sorted({key[1] for key in launched if key[1] in TREE_KERNELS}),
        "attention_launches_while_serving": attention,
        "kv_cache_groups": num_kv_cache_groups,
        "drafts": drafts,
    }))


if __name__ == "__main__":
    main()
