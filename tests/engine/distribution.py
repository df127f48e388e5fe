# SPDX-License-Identifier: Apache-2.0
"""Tests that speculative sampling keeps plain decoding's distribution:
seeded samples of the first tokens (their joint, cell by cell) compared with
exact probabilities (chi-square goodness of fit)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

# Cells expected fewer times than this in either sample are merged into one.
MIN_EXPECTED_COUNT = 5


@dataclass(frozen=True)
class GoodnessOfFit:
    statistic: float
    dof: int
    p_value: float
    total_variation: float
    num_cells: int
    # Observed outcomes that have probability 0.
    outside_support: int

    def __str__(self) -> str:
        return (
            f"chi2 {self.statistic:.1f} (dof {self.dof}, {self.num_cells} cells), "
            f"p = {self.p_value:.3g}, total variation {self.total_variation:.3f}, "
            f"{self.outside_support} samples outside the support"
        )


def goodness_of_fit(observed: Counter, probabilities: dict) -> GoodnessOfFit:
    """Chi-square test of a sample against exact outcome probabilities."""
    n = sum(observed.values())
    outside = sum(c for outcome, c in observed.items() if outcome not in probabilities)
    total_variation = 0.5 * (
        sum(abs(observed[o] / n - p) for o, p in probabilities.items()) + outside / n
    )
    table: list[tuple[int, float]] = []
    merged_observed, merged_expected = 0, 0.0
    for outcome, p in sorted(probabilities.items(), key=lambda item: -item[1]):
        if n * p < MIN_EXPECTED_COUNT:
            merged_observed += observed[outcome]
            merged_expected += n * p
        else:
            table.append((observed[outcome], n * p))
    if merged_expected > 0:
        table.append((merged_observed, merged_expected))
    statistic = sum((o - e) ** 2 / e for o, e in table)
    dof = max(len(table) - 1, 1)
    return GoodnessOfFit(statistic, dof, chi2_sf(statistic, dof), total_variation,
                         len(table), outside)


def chi2_sf(statistic: float, dof: int) -> float:
    import torch

    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64),
            torch.tensor(statistic / 2, dtype=torch.float64),
        )
    )
