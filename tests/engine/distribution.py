# SPDX-License-Identifier: Apache-2.0
"""Tests that speculative sampling keeps plain decoding's distribution:
seeded samples of the first tokens (their joint, cell by cell) compared with a
plain engine's samples (chi-square test of homogeneity) or with exact
probabilities (chi-square goodness of fit)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

# Cells expected fewer times than this in either sample are merged into one.
MIN_EXPECTED_COUNT = 5


@dataclass(frozen=True)
class Homogeneity:
    statistic: float
    dof: int
    p_value: float
    total_variation: float
    num_cells: int

    def __str__(self) -> str:
        return (
            f"chi2 {self.statistic:.1f} (dof {self.dof}, {self.num_cells} cells), "
            f"p = {self.p_value:.3g}, total variation {self.total_variation:.3f}"
        )


def homogeneity_test(first: Counter, second: Counter) -> Homogeneity:
    """Chi-square test that two samples of outcomes come from one
    distribution, and the total-variation distance of their frequencies."""
    n1, n2 = sum(first.values()), sum(second.values())
    cells = sorted(set(first) | set(second), key=lambda c: -(first[c] + second[c]))
    total_variation = 0.5 * sum(abs(first[c] / n1 - second[c] / n2) for c in cells)
    table: list[tuple[int, int]] = []
    merged = [0, 0]
    for cell in cells:
        pooled = first[cell] + second[cell]
        if min(pooled * n1, pooled * n2) / (n1 + n2) < MIN_EXPECTED_COUNT:
            merged[0] += first[cell]
            merged[1] += second[cell]
        else:
            table.append((first[cell], second[cell]))
    if sum(merged):
        table.append((merged[0], merged[1]))
    statistic = 0.0
    for a, b in table:
        pooled = a + b
        for observed, n in ((a, n1), (b, n2)):
            expected = pooled * n / (n1 + n2)
            statistic += (observed - expected) ** 2 / expected
    dof = max(len(table) - 1, 1)
    return Homogeneity(statistic, dof, chi2_sf(statistic, dof), total_variation,
                       len(table))


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
