"""Shared fixtures: tiny random Hugging Face checkpoints, each written once per test session; the
gateway tests' OpenAI client."""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# The test models are tiny: one intra-op thread is as fast as several on a quiet machine, and much
# faster on a busy one (spinning OpenMP workers of concurrent processes starve each other).
# Set OMP_NUM_THREADS to override; child processes (TP ranks) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Without a GPU the Triton kernels run in Triton's interpreter (tests/test_kernels.py, the static graph
# paths); it must be set before the first kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
for p in (str(ROOT), str(TESTS)):
    if p not in sys.path:
        sys.path.insert(0, p)

from triton_interpreter import skip_nested_repatching  # noqa: E402

skip_nested_repatching()  # (tests/tp_runner.py does the same in its processes)


# Each pytest-xdist worker starts services on ports of its own range (and so do the processes its tests start): a
# service restarted at its address found its port taken meanwhile by the other worker's (tandem.service_probe).
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and "TANDEM_PORT_RANGE" not in os.environ:
    from tandem.service_probe import PORT_RANGE_ENV, port_range  # noqa: E402

    _low, _high = port_range()
    _span = (_high - _low) // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    _first = _low + int(_worker[2:]) * _span
    os.environ[PORT_RANGE_ENV] = f"{_first}-{_first + _span}"

# pytest-xdist (pyproject's addopts: -n 2 --dist loadgroup). Tests that start process groups or CPU-heavy child
# processes are marked ``pytest.mark.xdist_group(PROCS)``: all on one worker, one after another, so that two of them
# never oversubscribe the cores at once (TP ranks under gloo time out that way).
PROCS = "procs"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Every other test is grouped by its file: a file's tests run on one worker, in order, and its module-scoped
    fixtures (tiny stacks of services, checkpoints) are built once instead of once per worker."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


@dataclass
class Checkpoint:
    path: str  # the model folder
    hf: object  # the transformers model holding the same weights (eval mode, float32)
    family: str


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(family, seed=0, max_shard_size=None, **config_overrides)`` → Checkpoint, cached."""
    from checkpoints import write_checkpoint

    cache: dict[tuple, Checkpoint] = {}

    def get(family: str, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Checkpoint:
        key = (family, seed, max_shard_size, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{family}-s{seed}")
            hf = write_checkpoint(path, family, seed, max_shard_size=max_shard_size, **copy.deepcopy(overrides))
            cache[key] = Checkpoint(str(path), hf, family)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def llama(checkpoint) -> Checkpoint:
    """The session's default tiny Llama (``checkpoint("llama")``)."""
    return checkpoint("llama")


@pytest.fixture(scope="module")
def pair(checkpoint, tmp_path_factory):
    """The EAGLE-3 tests' target + random draft (tests/draft_checkpoints.shared_pair, written once per
    session). Test files that need another pair define their own ``pair``."""
    from draft_checkpoints import shared_pair

    return shared_pair(checkpoint, tmp_path_factory)


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    """A target and its random draft as folders (``target/``, ``draft/``: draft_checkpoints.write_pair), for the
    service tests that start them as processes. Test files that need more beside them define their own."""
    from draft_checkpoints import write_pair

    root = tmp_path_factory.mktemp("pair")
    write_pair(root)
    return root


@pytest.fixture(scope="module")
def client(stack):
    """An OpenAI client of the module's gateway ``stack`` (tests/gateway_harness.stack_fixture)."""
    import openai

    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=20)
