# SPDX-License-Identifier: Apache-2.0
"""CUDA graphs as this CPU can have them: what a capture records, replayed.

A FULL graph replays the kernels its capture recorded, over the buffers they
read then, with the host values (sizes, metadata) of the capture. This CPU
cannot capture one, so `ReplayedGraphs` makes vLLM's `CudaGraphManager` keep
the forward function its capture would record (built by the speculator's own
capture code, with attention metadata built for a dummy batch) and run it
again, with no new argument, at every `run_fullgraph`. A draft step that read
anything but persistent buffers then drafts other tokens than the same step
run eagerly. Not covered: Python control flow inside the function runs again
at each replay (a graph would repeat the capture's), so the functions replayed
must take their host values from the capture, as the speculators' do.
"""

from __future__ import annotations

import contextlib

import torch


class ReplayedGraphs:
    def __init__(self, monkeypatch) -> None:
        from vllm.config.compilation import CUDAGraphMode
        from vllm.platforms import current_platform
        from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

        self.captured: list = []
        self.replays = 0
        recorder = self

        @torch.inference_mode()
        def capture(manager, create_forward_fn, progress_bar_desc="", stream=None):
            for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
                for desc in manager._capture_descs.get(mode, []):
                    create_forward_fn(desc, warmup=True)(CUDAGraphMode.NONE)
                    forward_fn = create_forward_fn(desc, warmup=False)
                    forward_fn(CUDAGraphMode.NONE)  # the captured run
                    manager.graphs[desc] = forward_fn
                    recorder.captured.append(desc)
            manager._graphs_captured = True

        def run_fullgraph(manager, desc):
            recorder.replays += 1
            manager.graphs[desc](CUDAGraphMode.NONE)

        # Engines here run eagerly: no graph pool.
        monkeypatch.setattr(type(current_platform), "get_global_graph_pool",
                            lambda self: None)
        monkeypatch.setattr(CudaGraphManager, "capture", capture)
        monkeypatch.setattr(CudaGraphManager, "run_fullgraph", run_fullgraph)

    @staticmethod
    def capture_sizes(vllm_config, monkeypatch, request_sizes: list[int]) -> None:
        """Decode graphs of `request_sizes` requests (an eager engine has
        none)."""
        compilation_config = vllm_config.compilation_config
        monkeypatch.setattr(compilation_config, "decode_cudagraph_capture_request_sizes",
                            request_sizes)
        monkeypatch.setattr(compilation_config, "max_cudagraph_capture_size",
                            max(request_sizes) * vllm_config.uniform_decode_query_len)
        monkeypatch.setattr(type(vllm_config), "get_draft_decode_cudagraph_request_sizes",
                            lambda self: request_sizes)

    @staticmethod
    @contextlib.contextmanager
    def eager(*managers):
        """Dispatches no graph while open."""
        captured = [manager._graphs_captured for manager in managers]
        for manager in managers:
            manager._graphs_captured = False
        try:
            yield
        finally:
            for manager, was in zip(managers, captured):
                manager._graphs_captured = was
