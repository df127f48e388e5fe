# SPDX-License-Identifier: Apache-2.0
"""The trained tiny Gemma 4 pair committed under tests/fixtures (made by
tests/fixtures/train_tiny_gemma4.py): a target that learned Python from the
standard library and an MTP assistant trained to predict it."""

from pathlib import Path

PAIR = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_gemma4_trained"


def trained_pair() -> tuple[Path, Path]:
    return PAIR / "target", PAIR / "assistant"


def text_prompts(count: int, length: int = 240) -> list[str]:
    """Snippets of standard library source: what the pair was trained on is
    code like this, so the assistant's drafts get accepted."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for path in sorted(stdlib.glob("*.py"))[::3]:
        text = path.read_text(errors="ignore")
        if len(text) > 4 * length:
            prompts.append(text[len(text) // 2 : len(text) // 2 + length])
        if len(prompts) == count:
            break
    return prompts


def perturbed_draft_model(noise: float = 0.3) -> Path:
    """A draft model for the target: the target's checkpoint with seeded
    Gaussian noise of `noise` times each weight tensor's standard deviation,
    so it drafts the target's token often but not always, and its runner-ups
    rescue some of its misses. Built once under build/fixtures."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    target, _ = trained_pair()
    out = Path(__file__).resolve().parents[2] / "build" / "fixtures" / f"perturbed-draft-{noise}"
    if (out / "model.safetensors").exists():
        return out
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(target, staging)
    generator = torch.Generator().manual_seed(0)
    weights = load_file(target / "model.safetensors")
    for name in sorted(weights):
        weight = weights[name]
        if weight.is_floating_point() and weight.numel() > 1:
            scale = noise * weight.float().std()
            weights[name] = (weight.float() + scale * torch.randn(
                weight.shape, generator=generator)).to(weight.dtype)
    save_file(weights, staging / "model.safetensors", metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out
