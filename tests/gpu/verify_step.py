# SPDX-License-Identifier: Apache-2.0
"""A whole step of tree speculative decoding at Gemma 4 E4B shapes, timed on
one GPU, and the tokens/s each configuration would serve projected from it.

Shapes, from transformers' Gemma 4 conversion script
(src/transformers/models/gemma4/convert_gemma4_weights.py, its E4B and E4B
assistant variants) and vLLM's Gemma 4 MTP defaults:

    target     42 layers, 5 sliding (window 512) : 1 full; hidden 2560; 8
               query heads, 2 KV heads, head_dim 256 (sliding) / 512 (full);
               MLP 10240 (E4B leaves use_double_wide_mlp off: it would double
               the KV-shared layers' MLP, as E2B's); the last 18 layers read
               the KV of the last earlier layer of their kind; per-layer
               embeddings of 256 per layer; vocab 262144, tied to the logits,
               final soft-cap 30
    assistant  hidden 256, 4 layers (3 sliding, 1 full), 4 query heads that
               attend to the target's KV (it writes none), MLP 2048; its input
               projects the token embedding and the target's state (2 x 2560)
               to 256 and its output back to 2560; centroid head: 2048
               centroids, the top 32 scored (4096 candidate tokens per row)

Weights are random bfloat16; every GEMM is torch's, the attention of every
layer (and of the assistant) the patched Triton kernel, the norms, RoPE and
activations plain torch ops (vLLM fuses some of them).

A step is the target's verify forward (B requests of n + 1 query rows each
at context C: embeddings, per-layer inputs, 42 layers with their KV writes,
the logits over the whole vocabulary for every row, their soft-cap and argmax)
plus the drafting of the next tree: one assistant forward per depth, whose
rows are the nodes of the depth above that have children (the root at depth
0), each taking its top-k. Left out: the scheduler and the rest of the CPU's
work per step, the tree walk and the accepted path's KV commit, prefills.

Each step shape is captured once in a CUDA graph and timed over its replays.
The projected tokens/s of a configuration is B x E[L] / step time, with E[L]
the mean acceptance length the E[L] harness measured on the trained tiny pair
(docs/benchmarks/el_results.json; an E4B pair's will differ), and the node
count a tree schedule would draft at each batch size is the one of the
configuration projected fastest there.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tests.gpu.tree_batches import (
    BLOCK_SIZE,
    ROOT,
    Replay,
    Request,
    batch_metadata,
    leaf_sibling_tree,
    planned_tree,
    run,
    time_ms,
)


@dataclass(frozen=True)
class TargetShapes:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: dict[str, int]
    window: int
    layer_kinds: tuple[str, ...]
    num_kv_shared_layers: int
    double_wide_mlp: bool
    per_layer_dim: int
    vocab: int
    softcap: float = 30.0


@dataclass(frozen=True)
class AssistantShapes:
    hidden: int
    intermediate: int
    heads: int
    layer_kinds: tuple[str, ...]
    centroids: int
    centroids_scored: int


E4B = TargetShapes(
    hidden=2560,
    intermediate=10240,
    heads=8,
    kv_heads=2,
    head_dim={"sliding": 256, "full": 512},
    window=512,
    layer_kinds=(("sliding",) * 5 + ("full",)) * 7,
    num_kv_shared_layers=18,
    double_wide_mlp=False,
    per_layer_dim=256,
    vocab=262144,
)
E4B_ASSISTANT = AssistantShapes(
    hidden=256,
    intermediate=2048,
    heads=4,
    layer_kinds=("sliding",) * 3 + ("full",),
    centroids=2048,
    centroids_scored=32,
)
# --smoke: every feature of the model at toy sizes (a double-wide MLP too).
TINY = TargetShapes(
    hidden=64,
    intermediate=96,
    heads=4,
    kv_heads=2,
    head_dim={"sliding": 32, "full": 64},
    window=16,  # wider than the deepest tree (10), as the kernel requires
    layer_kinds=("sliding", "sliding", "full", "sliding", "full"),
    num_kv_shared_layers=2,
    double_wide_mlp=True,
    per_layer_dim=8,
    vocab=512,
)
TINY_ASSISTANT = AssistantShapes(
    hidden=32,
    intermediate=64,
    heads=4,
    layer_kinds=("sliding", "full"),
    centroids=16,
    centroids_scored=4,
)

CHAIN_K3 = [(0,), (0, 0), (0, 0, 0)]
CONTEXTS = (1024, 8192)
BATCH_SIZES = (1, 4, 16, 64)
NODE_COUNTS = (0, 3, 12, 16, 32)


def configurations() -> dict[str, tuple[list | None, float]]:
    """Configuration -> (its tree, None for plain decoding; its E[L] on the
    trained pair, HumanEval, from the committed E[L] harness run)."""
    results = json.loads((ROOT / "docs/benchmarks/el_results.json").read_text())
    measured = results["results"]["humaneval"]
    planned = results["planner"]["budgets"]

    def mean_acceptance_length(name: str) -> float:
        return measured[name]["mean_acceptance_length"]

    configs = {
        "plain": (None, 1.0),
        "chain K=3": (CHAIN_K3, mean_acceptance_length("chain_k3")),
        "tree K=3 W=4": (leaf_sibling_tree(12), mean_acceptance_length("tree_k3_w4")),
        "tree K=4 W=4": (leaf_sibling_tree(16), mean_acceptance_length("tree_k4_w4")),
    }
    for budget in (12, 16, 32):
        configs[f"planned {budget}"] = (
            planned_tree(budget),
            planned[str(budget)]["planned"]["mean_acceptance_length"],
        )
    return configs


def draft_rows(paths: list[tuple[int, ...]]) -> list[int]:
    """The assistant's rows per request at each draft depth: the nodes of the
    depth above (the root at depth 0) that have children."""
    parents = {path[:-1] for path in paths}
    depth = max(len(path) for path in paths)
    return [sum(1 for p in parents if len(p) == d) for d in range(depth)]


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],))


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [tokens, heads, head_dim] at `positions`."""
    half = x.shape[-1] // 2
    inverse_frequency = 10000.0 ** (
        -torch.arange(half, device=x.device, dtype=torch.float32) / half
    )
    angles = positions[:, None].float() * inverse_frequency
    cos, sin = (t.to(x.dtype)[:, None] for t in (angles.cos(), angles.sin()))
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class Weights:
    def __init__(self, device: str, dtype: torch.dtype, seed: int):
        self.device, self.dtype = device, dtype
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, *shape: int) -> torch.Tensor:
        """A weight of `shape`, scaled to keep activations near unit size."""
        return self.noise(*shape) * (shape[0] ** -0.5)

    def noise(self, *shape: int) -> torch.Tensor:
        return torch.randn(
            *shape, device=self.device, dtype=self.dtype, generator=self.generator
        )


@dataclass
class TargetLayer:
    kind: str
    kv_source: int  # the layer whose KV cache it reads (itself unless shared)
    qkv: torch.Tensor  # query only in a KV-shared layer
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    per_layer_gate: torch.Tensor
    per_layer_projection: torch.Tensor


class Target:
    """The target model with random weights and a paged KV cache of
    `num_blocks` blocks per layer that writes KV."""

    def __init__(self, shapes: TargetShapes, num_blocks: int, device, dtype):
        self.shapes = shapes
        weight = Weights(device, dtype, seed=0)
        s = shapes
        first_shared = len(s.layer_kinds) - s.num_kv_shared_layers
        self.layers = []
        self.kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for index, kind in enumerate(s.layer_kinds):
            head_dim = s.head_dim[kind]
            shared = index >= first_shared
            kv_source = (
                max(i for i in range(first_shared) if s.layer_kinds[i] == kind)
                if shared
                else index
            )
            intermediate = s.intermediate * (2 if shared and s.double_wide_mlp else 1)
            kv_width = 0 if shared else 2 * s.kv_heads * head_dim
            self.layers.append(
                TargetLayer(
                    kind=kind,
                    kv_source=kv_source,
                    qkv=weight(s.hidden, s.heads * head_dim + kv_width),
                    o=weight(s.heads * head_dim, s.hidden),
                    gate_up=weight(s.hidden, 2 * intermediate),
                    down=weight(intermediate, s.hidden),
                    per_layer_gate=weight(s.hidden, s.per_layer_dim),
                    per_layer_projection=weight(s.per_layer_dim, s.hidden),
                )
            )
            if not shared:
                cache_shape = (num_blocks, BLOCK_SIZE, s.kv_heads, head_dim)
                self.kv_caches[index] = (
                    weight.noise(*cache_shape),
                    weight.noise(*cache_shape),
                )
        per_layer_width = len(s.layer_kinds) * s.per_layer_dim
        self.embedding = weight(s.vocab, s.hidden)
        self.per_layer_embedding = weight(s.vocab, per_layer_width)
        self.per_layer_model_projection = weight(s.hidden, per_layer_width)

    def forward(self, unified_attention, batch: dict) -> tuple[torch.Tensor, ...]:
        """The verify forward of `batch` (see `verify_batch`): the final
        hidden states and each row's greedy token."""
        s = self.shapes
        tokens, positions, slots = batch["tokens"], batch["positions"], batch["slots"]
        x = self.embedding[tokens] * s.hidden**0.5
        per_layer_inputs = (
            self.per_layer_embedding[tokens] + x @ self.per_layer_model_projection
        ).view(len(tokens), len(self.layers), s.per_layer_dim)
        for index, layer in enumerate(self.layers):
            head_dim = s.head_dim[layer.kind]
            qkv = rms_norm(x) @ layer.qkv
            q = rope(
                rms_norm(qkv[:, : s.heads * head_dim].view(-1, s.heads, head_dim)),
                positions,
            )
            if layer.kv_source == index:
                k, v = (
                    qkv[:, s.heads * head_dim :]
                    .view(-1, 2, s.kv_heads, head_dim)
                    .unbind(1)
                )
                key_cache, value_cache = self.kv_caches[index]
                key_cache.view(-1, s.kv_heads, head_dim).index_copy_(
                    0, slots, rope(rms_norm(k), positions)
                )
                value_cache.view(-1, s.kv_heads, head_dim).index_copy_(
                    0, slots, rms_norm(v)
                )
            key_cache, value_cache = self.kv_caches[layer.kv_source]
            attention = run(
                unified_attention,
                dict(
                    batch["attention"],
                    query=q,
                    key_cache=key_cache,
                    value_cache=value_cache,
                ),
                s.window if layer.kind == "sliding" else None,
                use_tree=batch["tree"],
            )
            x = x + rms_norm(attention.view(len(tokens), -1) @ layer.o)
            x = x + rms_norm(gelu_and_mul(rms_norm(x) @ layer.gate_up) @ layer.down)
            gated = F.gelu(x @ layer.per_layer_gate, approximate="tanh")
            x = x + rms_norm(
                (gated * per_layer_inputs[:, index]) @ layer.per_layer_projection
            )
        x = rms_norm(x)
        logits = torch.tanh((x @ self.embedding.T) / s.softcap) * s.softcap
        return x, logits.argmax(dim=-1)


@dataclass
class AssistantLayer:
    kind: str
    q: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class Assistant:
    """The MTP assistant with random weights; it attends to the KV caches of
    the target's last layer of each kind that writes KV."""

    def __init__(self, shapes: AssistantShapes, target: Target, device, dtype):
        self.shapes, self.target = shapes, target
        weight = Weights(device, dtype, seed=1)
        t = target.shapes
        self.kv_source = {
            kind: max(i for i in target.kv_caches if t.layer_kinds[i] == kind)
            for kind in set(shapes.layer_kinds)
        }
        self.layers = [
            AssistantLayer(
                kind=kind,
                q=weight(shapes.hidden, shapes.heads * t.head_dim[kind]),
                o=weight(shapes.heads * t.head_dim[kind], shapes.hidden),
                gate_up=weight(shapes.hidden, 2 * shapes.intermediate),
                down=weight(shapes.intermediate, shapes.hidden),
            )
            for kind in shapes.layer_kinds
        ]
        self.pre_projection = weight(2 * t.hidden, shapes.hidden)
        self.post_projection = weight(shapes.hidden, t.hidden)
        self.centroids = weight(shapes.hidden, shapes.centroids)
        self.token_ordering = torch.randperm(t.vocab, device=device).view(
            shapes.centroids, -1
        )
        self.lm_head = weight(t.vocab, shapes.hidden)

    def forward(
        self, unified_attention, batch: dict, width: int
    ) -> tuple[torch.Tensor, ...]:
        """One draft depth over `batch` (see `draft_batch`): each row's state
        for the next depth and its `width` best tokens."""
        s, t = self.shapes, self.target.shapes
        tokens = batch["tokens"]
        x = torch.cat((self.target.embedding[tokens], batch["hidden"]), dim=-1)
        x = x @ self.pre_projection
        for layer in self.layers:
            head_dim = t.head_dim[layer.kind]
            q = rope(
                rms_norm((rms_norm(x) @ layer.q).view(-1, s.heads, head_dim)),
                batch["positions"],
            )
            key_cache, value_cache = self.target.kv_caches[self.kv_source[layer.kind]]
            attention = run(
                unified_attention,
                dict(
                    batch["attention"],
                    query=q,
                    key_cache=key_cache,
                    value_cache=value_cache,
                ),
                t.window if layer.kind == "sliding" else None,
                use_tree=False,
            )
            x = x + rms_norm(attention.view(len(tokens), -1) @ layer.o)
            x = x + rms_norm(gelu_and_mul(rms_norm(x) @ layer.gate_up) @ layer.down)
        x = rms_norm(x)
        top_centroids = (x @ self.centroids).topk(s.centroids_scored, dim=-1).indices
        candidates = self.token_ordering[top_centroids].flatten(1)
        scores = torch.einsum("td,tcd->tc", x, self.lm_head[candidates])
        best = candidates.gather(1, scores.topk(width, dim=-1).indices)
        return x @ self.post_projection, best


def verify_batch(
    requests: list[Request],
    tree: bool,
    vocab: int,
    blocks_per_request: int,
    device,
    seed: int = 0,
) -> dict:
    """The target's inputs for `requests`: random tokens, RoPE positions
    (context + depth in a tree), the KV slots of the rows (their flat
    positions) and the kernel's metadata."""
    generator = torch.Generator().manual_seed(seed)
    attention = batch_metadata(requests, device, blocks_per_request)
    positions, slots = [], []
    for r, request in enumerate(requests):
        for i in range(request.query_len):
            depth = request.depths[i] if request.depths[i] is not None else i
            positions.append(request.context_len + depth)
            flat = request.context_len + i
            block = 1 + r * blocks_per_request + flat // BLOCK_SIZE
            slots.append(block * BLOCK_SIZE + flat % BLOCK_SIZE)
    return dict(
        tokens=torch.randint(vocab, (len(positions),), generator=generator).to(device),
        positions=torch.tensor(positions, device=device),
        slots=torch.tensor(slots, device=device),
        attention=attention,
        tree=tree,
    )


def draft_batch(
    batch_size: int,
    rows: int,
    context: int,
    depth: int,
    shapes: TargetShapes,
    blocks_per_request: int,
    device,
    dtype,
) -> dict:
    """One draft depth's inputs: `rows` rows per request, each a query of
    its own over the request's context and root (the assistant attends to
    the target's KV at a fixed position), at RoPE position context + depth."""
    requests = [Request(context) for _ in range(batch_size) for _ in range(rows)]
    attention = batch_metadata(requests, device, blocks_per_request)
    attention["block_table"] = attention["block_table"][:batch_size].repeat_interleave(
        rows, 0
    )
    num_rows = batch_size * rows
    return dict(
        tokens=torch.randint(shapes.vocab, (num_rows,), device=device),
        hidden=torch.randn(num_rows, shapes.hidden, device=device, dtype=dtype),
        positions=torch.full((num_rows,), context + depth, device=device),
        attention=attention,
    )


def verify_requests(num_nodes: int, batch_size: int, context: int) -> tuple[list, bool]:
    """The verify rows of a step at `num_nodes`: a plain decode (0), chain
    K=3's causal rows (3), else a leaf-sibling tree of W = 4 (the kernel's
    work depends on the node count only)."""
    if num_nodes == 0:
        return [Request(context) for _ in range(batch_size)], False
    if num_nodes == 3:
        return [Request(context, query_len=4) for _ in range(batch_size)], False
    paths = leaf_sibling_tree(num_nodes)
    return [Request(context, paths=paths) for _ in range(batch_size)], True


def consistency(
    unified_attention, target: Target, blocks_per_request: int, device
) -> dict:
    """The model verifies a tree as decoding does: the deepest node of a
    planned 32-node tree gets the same final state as the same tokens decoded
    as a chain (its path's rows, causal, no tree inputs), and the root the
    same as a plain decode step. Float32 only (bfloat16 GEMMs of other row
    counts round differently)."""
    context = 40
    paths = planned_tree(32)
    tree = verify_batch(
        [Request(context, paths=paths)],
        True,
        target.shapes.vocab,
        blocks_per_request,
        device,
    )
    deepest = max(paths, key=len)
    rows = [0] + [1 + paths.index(deepest[:end]) for end in range(1, len(deepest) + 1)]
    chain = verify_batch(
        [Request(context, query_len=len(rows))],
        False,
        target.shapes.vocab,
        blocks_per_request,
        device,
    )
    chain["tokens"] = tree["tokens"][rows]
    tree_state, _ = target.forward(unified_attention, tree)
    chain_state, _ = target.forward(unified_attention, chain)
    error = float((tree_state[rows] - chain_state).abs().max())
    # Negative control: the tree's rows verified as one causal run.
    flat_state, _ = target.forward(unified_attention, dict(tree, tree=False))
    control = float((flat_state[rows] - chain_state).abs().max())
    return {
        "max_abs_error": error,
        "without_tree_inputs_max_abs_error": control,
        "passed": error <= 1e-4 < control,
    }


def step_times(unified_attention, device, dtype, smoke: bool, deadline: float) -> dict:
    """Verify and drafting times per batch size, node count and context, and
    the configurations' projected tokens/s."""
    shapes, assistant_shapes = (TINY, TINY_ASSISTANT) if smoke else (E4B, E4B_ASSISTANT)
    contexts, batches = ((40,), (1, 2)) if smoke else (CONTEXTS, BATCH_SIZES)
    node_counts = (0, 3, 12) if smoke else NODE_COUNTS
    configs = configurations()
    if smoke:
        configs = {n: c for n, c in configs.items() if c[0] is None or len(c[0]) <= 12}
    width = 4
    # Room for every context plus a root and the largest tree (32 nodes).
    blocks_per_request = -(-(max(contexts) + 1 + 32) // BLOCK_SIZE)
    started = time.perf_counter()
    target = Target(shapes, max(batches) * blocks_per_request + 1, device, dtype)
    assistant = Assistant(assistant_shapes, target, device, dtype)
    print(
        f"  random weights and KV caches: {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    results: dict = {
        "shapes": {"target": shapes.__dict__, "assistant": assistant_shapes.__dict__}
    }
    if dtype == torch.float32:
        results["consistency"] = consistency(
            unified_attention, target, blocks_per_request, device
        )
        print(
            f"  a tree's deepest path against the same tokens decoded as a chain: "
            f"max |error| {results['consistency']['max_abs_error']:.2e}, "
            f"{results['consistency']['without_tree_inputs_max_abs_error']:.2e} "
            "without the tree inputs",
            flush=True,
        )
    repeats = 2 if smoke else 20
    skipped = []

    def timed(make_call) -> tuple[float, str] | None:
        if time.perf_counter() > deadline:
            return None
        call = make_call()
        try:
            replay, mode = (
                Replay(call, device),
                "graph" if device == "cuda" else "eager",
            )
        except RuntimeError as error:  # a shape the graph capture cannot take
            print(f"    graph capture failed ({error}); timing eagerly", flush=True)
            replay, mode = call, "eager"
        ms = time_ms(replay, device, repeats)
        del replay
        if device == "cuda":
            torch.cuda.empty_cache()
        return ms, mode

    rows_needed = sorted(
        {r for paths, _ in configs.values() if paths for r in draft_rows(paths)}
    )
    for context in contexts:
        for batch_size in batches:
            key = f"ctx {context} batch {batch_size}"
            verify, draft = {}, {}
            for num_nodes in node_counts:
                requests, tree = verify_requests(num_nodes, batch_size, context)
                batch = verify_batch(
                    requests, tree, shapes.vocab, blocks_per_request, device
                )
                measured = timed(
                    lambda b=batch: lambda: target.forward(unified_attention, b)
                )
                if measured is None:
                    skipped.append(f"{key} verify n={num_nodes}")
                    continue
                verify[num_nodes] = {"ms": measured[0], "timing": measured[1]}
            for rows in rows_needed:
                batch = draft_batch(
                    batch_size,
                    rows,
                    context,
                    1,
                    shapes,
                    blocks_per_request,
                    device,
                    dtype,
                )
                measured = timed(
                    lambda b=batch: lambda: assistant.forward(
                        unified_attention, b, width
                    )
                )
                if measured is None:
                    skipped.append(f"{key} draft rows={rows}")
                    continue
                draft[rows] = {"ms": measured[0], "timing": measured[1]}
            projected = project(configs, verify, draft, batch_size)
            results[key] = {
                "verify_ms_by_num_nodes": {str(n): v for n, v in verify.items()},
                "draft_depth_ms_by_rows": {str(r): v for r, v in draft.items()},
                "projected": projected,
            }
            print(
                f"  {key}: verify "
                + ", ".join(f"n={n} {v['ms']:.2f}" for n, v in verify.items())
                + " ms; a draft depth "
                + ", ".join(f"{r} rows {v['ms']:.2f}" for r, v in draft.items())
                + " ms"
                + (
                    f"; schedule n={projected['schedule_num_nodes']} "
                    f"({projected['best']})"
                    if projected.get("best")
                    else ""
                ),
                flush=True,
            )
    results["skipped_past_time_limit"] = skipped
    if skipped:
        print(f"  skipped past the time limit: {', '.join(skipped)}", flush=True)
    return results


def project(configs: dict, verify: dict, draft: dict, batch_size: int) -> dict:
    """Each configuration's step time and tokens/s at this batch size, and the
    fastest one's node count (what a tree schedule drafts here)."""
    by_config = {}
    for name, (paths, mean_acceptance_length) in configs.items():
        num_nodes = len(paths) if paths else 0
        rows = draft_rows(paths) if paths else []
        if num_nodes not in verify or any(r not in draft for r in rows):
            continue
        step_ms = verify[num_nodes]["ms"] + sum(draft[r]["ms"] for r in rows)
        by_config[name] = {
            "num_nodes": num_nodes,
            "draft_depths": len(rows),
            "mean_acceptance_length": mean_acceptance_length,
            "step_ms": step_ms,
            "tokens_per_s": 1000 * batch_size * mean_acceptance_length / step_ms,
        }
    if not by_config:
        return {}
    best = max(by_config, key=lambda n: by_config[n]["tokens_per_s"])
    return {
        "by_config": by_config,
        "best": best,
        "schedule_num_nodes": by_config[best]["num_nodes"],
    }
