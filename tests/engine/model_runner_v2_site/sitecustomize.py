# SPDX-License-Identifier: Apache-2.0
"""Test-only: every Python process started with this directory on PYTHONPATH
(a `vllm serve` and its engine process, see tests/engine/test_serve.py) runs
Model Runner V2 as the tests' own process does
(tests/engine/model_runner_v2.py)."""

from tests.engine import model_runner_v2

model_runner_v2.install()
