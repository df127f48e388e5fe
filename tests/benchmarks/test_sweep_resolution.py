# SPDX-License-Identifier: Apache-2.0
"""sweep_resolution.py on synthetic sweeps: the noise it reads from a control
and how often a goal it simulates passes."""

import math

import pytest

from tests.benchmarks.sweep_resolution import goal_probability, run_noise


def sweep(control_runs: list[float], twin_runs: list[float]) -> dict:
    def cell() -> dict:
        return {
            "plain": {"output_throughput": 100.0, "output_throughput_runs": twin_runs},
            "plain_control": {"output_throughput": 100.0,
                              "output_throughput_runs": control_runs},
            "chain_k3": {"output_throughput": 80.0},
            "adaptive_k3_w4": {"output_throughput": 97.0},
        }

    return {"setup": {"control": "plain", "rounds": len(twin_runs)},
            "1": cell(), "16": cell()}


def test_noise_from_the_control_pairs_about_one():
    noise, pairs = run_noise(sweep([110.0, 100.0], [100.0, 110.0]))
    assert pairs == 4
    # Each pair's log ratio is +-log 1.1; one run carries 1/sqrt(2) of it.
    assert noise == pytest.approx(math.log(1.1) / math.sqrt(2))
    # A constant offset between two identical servers counts as noise too.
    offset, _ = run_noise(sweep([105.0, 105.0], [100.0, 100.0]))
    assert offset == pytest.approx(math.log(1.05) / math.sqrt(2))


def test_one_round_sweeps_keep_only_their_run():
    result = sweep([100.0], [100.0])
    for cell in (result["1"], result["16"]):
        for name in ("plain", "plain_control"):
            del cell[name]["output_throughput_runs"]
    assert run_noise(result) == (0.0, 2)
    assert run_noise({"setup": {}, "1": {}}) is None


def test_without_noise_an_equal_server_always_passes():
    probability, per_concurrency = goal_probability(sweep([100.0], [100.0]), 0.0, 3)
    assert probability == 1.0 and per_concurrency == [1.0, 1.0]


def test_noise_fails_an_equal_server_and_rounds_recover_it():
    noisy = sweep([100.0], [100.0])
    three, per_concurrency = goal_probability(noisy, 0.05, 3)
    assert 0.2 < min(per_concurrency) < 0.8
    # Two concurrencies must both pass: about the product of their shares.
    assert three == pytest.approx(per_concurrency[0] * per_concurrency[1], abs=0.02)
    assert goal_probability(noisy, 0.05, 21)[0] > three
    assert goal_probability(noisy, 0.2, 3)[0] < three
