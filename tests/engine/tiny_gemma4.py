# SPDX-License-Identifier: Apache-2.0
"""Tiny Gemma 4 checkpoints made offline: a target and its MTP assistant.

The target mixes sliding-window and full-attention layers like the real model;
the assistant is a one-layer `Gemma4AssistantForCausalLM` reading the target's
KV. Weights are random (seeded); the tokenizer is a byte-level BPE trained on
the Python standard library's source, which every machine has.

At random initialization the target's next-token distributions are nearly
flat (logit std ~0.16 over 512 tokens), so greedy paths hang on near-ties that
the last bits of a kernel decide differently per CPU. Its final norm is scaled
by `TinyGemma4Spec.logit_scale` at construction, which multiplies every logit
(Gemma 4 norms scale by `weight` directly, and the tiny model has no final
softcap). Plain greedy decoding of 64 random prompts of the kind
tests/engine/test_tree_verify.py draws (24 steps each) then has a median top-2
logprob margin of 0.88 nats (0.037 unscaled) and a smallest one of 5.6e-4,
56 times the tie tolerance of tests/engine/identity.py, with a median top-1
logprob of -0.89 (-5.8 unscaled). Scaling cannot separate logits that are
equal to fp32 precision; seed 0 had one such pair on the path (prompt 28,
step 7: tokens 123 and 348, margin 8e-8 unscaled), so the seed is 3.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>"]  # ids 0, 1, 2 as Gemma 4 expects


@dataclass(frozen=True)
class TinyGemma4Spec:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 3
    sliding_window: int = 16
    head_dim: int = 32
    global_head_dim: int = 64
    max_position_embeddings: int = 2048
    # Multiplies the target's logits (see the module docstring).
    logit_scale: float = 24.0
    seed: int = 3

    @property
    def layer_types(self) -> list[str]:
        # Sliding layers first and a full layer last, as in Gemma 4.
        return ["sliding_attention"] * (self.num_hidden_layers - 1) + ["full_attention"]

    def digest(self) -> str:
        source = Path(__file__).read_bytes()
        payload = json.dumps(asdict(self), sort_keys=True).encode() + source
        return hashlib.sha256(payload).hexdigest()[:12]


def corpus_files(limit: int = 60) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [str(p) for p in sorted(stdlib.glob("*.py"))[:limit]]


def train_tokenizer(vocab_size: int, out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(corpus_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
    )
    fast.save_pretrained(out_dir)


def text_config(spec: TinyGemma4Spec, num_layers: int, layer_types: list[str]):
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=spec.head_dim,
        global_head_dim=spec.global_head_dim,
        sliding_window=spec.sliding_window,
        layer_types=layer_types,
        max_position_embeddings=spec.max_position_embeddings,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )


def build_tiny_pair(root: Path, spec: TinyGemma4Spec = TinyGemma4Spec()) -> tuple[Path, Path]:
    """Writes (target_dir, assistant_dir) under root, reusing an earlier build
    of the same spec and builder source."""
    import torch
    from transformers import (
        Gemma4AssistantConfig,
        Gemma4AssistantForCausalLM,
        Gemma4ForCausalLM,
    )

    out = root / f"tiny-gemma4-{spec.digest()}"
    target_dir, assistant_dir = out / "target", out / "assistant"
    if (out / "done").exists():
        return target_dir, assistant_dir
    shutil.rmtree(out, ignore_errors=True)
    target_dir.mkdir(parents=True)
    assistant_dir.mkdir(parents=True)
    train_tokenizer(spec.vocab_size, target_dir)
    train_tokenizer(spec.vocab_size, assistant_dir)

    torch.manual_seed(spec.seed)
    config = text_config(spec, spec.num_hidden_layers, spec.layer_types)
    config.architectures = ["Gemma4ForCausalLM"]
    target = Gemma4ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        target.model.norm.weight.mul_(spec.logit_scale)
    target.save_pretrained(target_dir)

    assistant_config = Gemma4AssistantConfig(
        text_config=text_config(spec, 1, ["full_attention"]),
        backbone_hidden_size=spec.hidden_size,
        use_ordered_embeddings=False,
    )
    assistant_config.architectures = ["Gemma4AssistantForCausalLM"]
    assistant = Gemma4AssistantForCausalLM(assistant_config).to(torch.float32)
    assistant.save_pretrained(assistant_dir)
    (out / "done").write_text(spec.digest())
    return target_dir, assistant_dir


if __name__ == "__main__":
    import sys

    print(*build_tiny_pair(Path(sys.argv[1] if len(sys.argv) > 1 else "build/fixtures")))
