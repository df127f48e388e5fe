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
