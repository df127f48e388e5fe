# SPDX-License-Identifier: Apache-2.0
"""Test-only: vLLM's Model Runner V2 on the CPU build, as CUDA users run it.

x86 CPUs run V2 (`vllm/v1/worker/cpu/model_runner.py`) only with triton-cpu,
which no registry serves. Triton's interpreter runs V2's kernels on CPU
tensors instead: with it installed before vLLM is imported, the CPU worker
builds V2 with CPU_ATTN. `install()` also keeps async scheduling on (the CPU
platform turns it off for every configuration; on CUDA it is the default),
routes top-k/top-p to upstream's torch path, lets the interpreter take
integer masks as a GPU does, and registers the
tests' host drafters (tests/engine/host_drafter.py). Call it before anything
imports vLLM, in every process that runs an engine (`sitecustomize.py` beside
this file does it for servers).
"""

from __future__ import annotations

import os
import sys


def use_triton_interpreter() -> None:
    """Hand Triton back to the CPU build, its kernels run by the interpreter;
    before anything imports vLLM's kernels."""
    os.environ["TRITON_INTERPRET"] = "1"

    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    _accept_integer_masks()
    _patch_language_once_per_launch()
    _compile_options_as_served()

    import vllm.triton_utils as triton_utils
    from vllm.triton_utils import importing

    triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice
    triton_utils.HAS_TRITON = importing.HAS_TRITON = True


def select_triton_attention(setattr=setattr) -> None:
    """TRITON_ATTN, the CUDA backend with tree attention, for every attention
    layer instead of CPU_ATTN (the CPU platform always picks CPU_ATTN); its
    KV cache writer asks CUDA for the device capability, a tuning choice only.
    `setattr`: e.g. a pytest monkeypatch's, to undo it after a test."""
    import torch

    from vllm.platforms import cpu
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cpu_backend = cpu.CpuPlatform.get_attn_backend_cls.__func__

    def triton_attn(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_mla or attn_selector_config.use_sparse:
            return cpu_backend(cls, selected_backend, attn_selector_config, num_heads)
        return AttentionBackendEnum.TRITON_ATTN.get_path()

    setattr(cpu.CpuPlatform, "get_attn_backend_cls", classmethod(triton_attn))
    setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0))


def install() -> None:
    use_triton_interpreter()

    from vllm.v1.sample.ops import topk_topp_sampler

    # Upstream's torch top-k/top-p: the Triton kernel's `row_id.to` fails in
    # the interpreter.
    topk_topp_sampler.HAS_TRITON = False

    from vllm.platforms import cpu

    check_and_update_config = cpu.CpuPlatform.check_and_update_config.__func__

    def keep_async_scheduling(cls, vllm_config) -> None:
        async_scheduling = vllm_config.scheduler_config.async_scheduling
        check_and_update_config(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = async_scheduling
        # For the logs of servers this process starts (tests/engine/test_serve.py).
        print(f"tests/engine/model_runner_v2.py: async_scheduling={async_scheduling}",
              file=sys.stderr, flush=True)

    cpu.CpuPlatform.check_and_update_config = classmethod(keep_async_scheduling)

    from tests.engine import host_drafter

    host_drafter.register()


def _compile_options_as_served() -> None:
    """The interpreter checks every 32-bit integer add, sub and mul for
    overflow (in int64, with a device assert: half of a TRITON_ATTN step's
    time here); a GPU checks only kernels compiled with debug=True, which
    vLLM does not serve. Engine tests (and vLLM's own tests in CI,
    ci/vllm_own_tests.py) run the kernels as served; the kernel tests the
    patches add to vLLM's tree (TRITON_INTERPRET=1 alone) keep the check."""
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


def _patch_language_once_per_launch() -> None:
    """The interpreter patches `triton.language` for the interpreter again at
    every call of a `@triton.jit` helper inside a kernel (an
    `inspect.getmembers` of the language modules each time: a third of a V2
    tree step here). The patches depend only on which language modules the
    function sees, and its launch has already made them for those modules, so
    a helper call patches only modules its launch has not."""
    import functools
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = interpreter._patch_lang
    run_grid = interpreter.GridExecutor.__call__
    # Per launch in progress: the language modules patched for it.
    patched_per_launch: list[set[int]] = []

    @functools.cache
    def language_modules(fn) -> frozenset[int]:
        return frozenset(id(value) for value in fn.__globals__.values()
                         if inspect.ismodule(value) and value in (tl, tl.core))

    def patch_lang_once(fn):
        modules = language_modules(fn)
        if patched_per_launch and modules <= patched_per_launch[-1]:
            return interpreter._LangPatchScope()
        scope = patch_lang(fn)
        if patched_per_launch:
            patched_per_launch[-1].update(modules)
        return scope

    def run_grid_patching_once(self, *args, **kwargs):
        patched_per_launch.append(set())
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            patched_per_launch.pop()

    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = run_grid_patching_once


def _accept_integer_masks() -> None:
    """The interpreter gives a scalar condition combined with a vector one
    (`is_active & (block < n)`, as in V2's grammar bitmask kernel) an int32
    mask, which its load and store then refuse; a GPU takes it as a boolean."""
    import numpy as np
    from triton.runtime import interpreter

    native = interpreter._interpreter
    load, store = native.load, native.store

    def load_with_mask(ptrs, mask, other, dtype):
        return load(ptrs, mask.astype(np.bool_), other, dtype)

    def store_with_mask(ptrs, value, mask):
        return store(ptrs, value, mask.astype(np.bool_))

    native.load, native.store = load_with_mask, store_with_mask
