"""How many torch threads one test process uses.

``make test`` runs the suite in pytest-xdist workers. Left alone, every torch process (each
worker, and each server or Ray replica a test starts) takes one OpenMP thread per core, so two
workers on two cores run four threads that spin while they wait at a barrier. A thread waiting
for one the OS has descheduled burns its timeslice, and small operations (a decode step, a LoRA
delta) slow down many times over: the LoRA mixed-batch test took 1.9 s alone and 110 s in the
suite beside the Gemma tests. The cores are split evenly among the workers instead.
``tests/conftest.py`` sets ``OMP_NUM_THREADS`` from this in the controller before the workers
start, so they, and the servers and scripts the tests start, inherit it.
"""

from __future__ import annotations

import os


def threads_per_process(workers: int) -> int:
    """The cores this process may run on, divided among ``workers`` processes (at least 1)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, workers))
