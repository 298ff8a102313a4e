"""The engine's glibc settings (``engine/host_allocator.py``): freed blocks of megabytes stay in
the heap for the next step, unless the user's environment sets the thresholds itself.

Each case runs in a fresh process (the settings are process-wide and glibc's state is its
own there): it optionally starts an engine, allocates 25 blocks of 8 MiB with ``malloc`` and
frees them, and reports glibc's ``mallinfo2``: bytes in mapped blocks while they are held,
and free bytes kept in the heap after they are freed.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the settings are glibc's")

PROBE = """
import ctypes, json, sys
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = Info
if sys.argv[1] == "engine":
    from prefixserve import LLM
    LLM(device="cpu", num_blocks=16)
warm = libc.malloc(32 << 20)  # glibc's dynamic thresholds rise to their largest
libc.free(warm)
blocks = [libc.malloc(8 << 20) for _ in range(25)]
for block in blocks:
    ctypes.memset(block, 1, 8 << 20)
mapped = libc.mallinfo2().hblkhd
for block in blocks:
    libc.free(block)
print(json.dumps({"mapped_while_held": mapped, "kept_free": libc.mallinfo2().fordblks}))
"""


def probe(mode: str, **env: str) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=300, check=True)
    result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_an_engine_on_the_cpu_keeps_freed_megabytes_in_the_heap() -> None:
    """After an engine has started on the CPU, 25 blocks of 8 MiB come from the heap and
    stay there, free, when released (200 MiB for the next step). With glibc's own dynamic
    thresholds all but ~64 MiB of them would be trimmed back to the kernel, and without an
    engine they are mapped one by one."""
    engine = probe("engine")
    assert engine["mapped_while_held"] < 8 << 20
    assert engine["kept_free"] >= 200 << 20
    plain = probe("plain")
    assert plain["mapped_while_held"] >= 200 << 20 and plain["kept_free"] < 8 << 20


@pytest.mark.parametrize("env", [
    {"MALLOC_TRIM_THRESHOLD_": str(64 << 20)},
    {"GLIBC_TUNABLES": f"glibc.malloc.trim_threshold={64 << 20}"},
], ids=["MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"])
def test_thresholds_set_in_the_environment_are_left_alone(env: dict[str, str]) -> None:
    """A trim threshold in the environment (the legacy variable or glibc's tunables) is the
    user's choice: the engine changes neither threshold, and glibc trims the freed blocks at
    the user's 64 MiB."""
    result = probe("engine", **env)
    assert result["kept_free"] < 200 << 20
