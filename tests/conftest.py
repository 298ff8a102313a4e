"""Makes the test helpers importable from the tests, and starts the longest test files first.

``make test`` runs the files in two pytest-xdist workers (``--dist loadfile``), which take files
in collection order. A long file collected last keeps one worker busy while the other idles, so
the files below (each a minute or more on 2 cores, measured with ``--durations``) are moved to
the front. The order only schedules: every file still runs whole, on one worker.

Each worker also gets its share of the cores as torch threads (``OMP_NUM_THREADS``, inherited by
the processes the tests start; ``tests/torch_threads.py`` says why), unless the variable is set.
"""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from torch_threads import threads_per_process

LONGEST_FIRST = (
    "test_model_gemma3.py",
    "test_serve_ray.py",
    "test_deterministic.py",
    "test_server_guarded.py",
    "test_agents_api.py",
    "test_kv_tiers_server.py",
    "test_kv_tiers_engine.py",
    "test_engine_retention.py",
    "test_server_soak.py",
    "test_model_smollm2.py",
)


def pytest_configure(config: pytest.Config) -> None:
    """Before the xdist workers start (they inherit it) or, run serially, before a test module
    imports torch: one worker's share of the cores as ``OMP_NUM_THREADS``."""
    if "PYTEST_XDIST_WORKER" in os.environ or "OMP_NUM_THREADS" in os.environ:
        return  # a worker inherits the controller's value; a value set by the user is kept
    workers = config.getoption("numprocesses", None) or 1
    os.environ["OMP_NUM_THREADS"] = str(threads_per_process(int(workers)))
    if "torch" in sys.modules:  # a plugin imported torch first: the variable came too late
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: keeps the rest
