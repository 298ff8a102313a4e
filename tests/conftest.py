"""Makes the test helpers importable from the tests, and starts the longest test files first.

``make test`` runs the files in two pytest-xdist workers (``--dist loadfile``), which take files
in collection order. A long file collected last keeps one worker busy while the other idles, so
the files below (each a minute or more on 2 cores, measured with ``--durations``) are moved to
the front. The order only schedules: every file still runs whole, on one worker.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: keeps the rest
