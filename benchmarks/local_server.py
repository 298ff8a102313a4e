"""A ``prefixserve serve`` process on 127.0.0.1 for the benchmarks that drive one over HTTP
(``bench_tiers.py``, ``long_prefill.py``): a free port, and the process once ``/health``
answers."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(flags: Sequence[str], log: Path | None = None,
                 timeout: float = 300) -> tuple[subprocess.Popen[bytes], str]:
    """Starts ``prefixserve serve --port PORT --disable-access-log --log-stats-interval 0
    FLAGS`` (its output to ``log``, or nowhere) and returns the process and its URL once
    ``/health`` answers; exits with a message when it does not within ``timeout`` seconds."""
    import httpx

    port = free_port()
    command = [sys.executable, "-m", "prefixserve", "serve", "--port", str(port),
               "--disable-access-log", "--log-stats-interval", "0", *flags]
    out = log.open("wb") if log is not None else subprocess.DEVNULL
    process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the server did not start{f'; see {log}' if log else ''}")
