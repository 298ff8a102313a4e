"""A real ``prefixserve serve`` process on 127.0.0.1 for the server tests, and helpers to read
its ``/metrics``."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

STARTUP_TIMEOUT = 180.0

HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
"""The tests' plain HTTP calls (``HTTP.get``, ``HTTP.post``, ...; httpx's defaults, a 5 s
timeout). ``httpx.get`` and its kin build a client per call, and with it a TLS context that
loads the CA bundle: ~50 ms of CPU even for ``http://``, 20 times a second while a test polls.
One client makes it once per process; no connection is kept alive, so each call opens its own
as ``httpx.get`` does."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ForkedServer:
    """A server that ``tests/server_zygote.py`` forked, with the calls of ``subprocess.Popen``
    that the tests make (``pid``, ``returncode``, ``poll``, ``wait``, signals)."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self.zygote.exits.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.zygote.changed:
            if not self.zygote.changed.wait_for(lambda: self.pid in self.zygote.exits
                                                or not self.zygote.alive, timeout):
                raise subprocess.TimeoutExpired(f"server {self.pid}", timeout or 0.0)
        if self.returncode is None:
            raise RuntimeError(f"the zygote ended before server {self.pid}")
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """``tests/server_zygote.py`` for this test process: servers forked from one process that
    imported the server once (its docstring says why and how). Used for a server only while
    this process's environment is the one it had before any test changed it (``_BASE_ENV``)."""

    IGNORED = ("PYTEST_CURRENT_TEST",)
    """Set by pytest for each test: not part of what a server's imports read."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("server_zygote.py"))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.exits: dict[int, int] = {}
        self.alive = True
        self.changed = threading.Condition()
        self.started: queue.Queue[int] = queue.Queue()
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    @classmethod
    def environment(cls) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k not in cls.IGNORED}

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            kind, *numbers = line.split()
            if kind == b"started":
                self.started.put(int(numbers[0]))
            else:
                with self.changed:
                    self.exits[int(numbers[0])] = int(numbers[1])
                    self.changed.notify_all()
        with self.changed:
            self.alive = False
            self.changed.notify_all()

    def fork(self, argv: Sequence[str], log_path: Path) -> ForkedServer:
        request = {"argv": list(argv), "log": str(log_path), "cwd": os.getcwd(),
                   "env": {**os.environ, "PYTHONUNBUFFERED": "1"}}
        assert self.process.stdin is not None
        with self.lock:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
            return ForkedServer(self, self.started.get(timeout=STARTUP_TIMEOUT))


_zygotes: list[Zygote] = []
"""This test process's zygote, once a server has needed it."""

_BASE_ENV = Zygote.environment()
"""The test process's environment before any test changed it: a zygote starts only in it, so
that one started during a test that set a variable does not serve that test's environment to
the servers of the tests after it (they would all be started anew)."""


def _fork_server(argv: Sequence[str], log_path: Path) -> ForkedServer | None:
    """The server forked by this process's zygote, or None where it must be started anew: a
    zygote turned off (``PREFIXSERVE_TEST_FORK=0``), an environment a test changed, or an
    OS other than Linux (macOS's system libraries are not safe to use after a fork)."""
    if os.environ.get("PREFIXSERVE_TEST_FORK", "1") == "0" or sys.platform != "linux":
        return None
    if Zygote.environment() != _BASE_ENV:
        return None
    if not _zygotes or not _zygotes[-1].alive:
        _zygotes.append(Zygote())
    return _zygotes[-1].fork(argv, log_path)


class ServerProcess:
    """``python -m prefixserve serve ARGS`` on a free port, its output in ``log_path``.

    ``metrics_key`` is sent to ``/metrics`` when the server protects it. ``start`` returns once
    ``/health`` answers 200 (or fails with the log if the process dies
    or does not come up in time); ``stop`` sends SIGTERM and returns the exit status.
    ``wrapper`` is a command that runs the server as its arguments and ends with ``exec`` of
    them (so that ``process`` is the server itself), e.g. one that mounts a file system first.

    Without a wrapper or ``--replicas`` (Ray starts its own processes), the server is forked
    from this test process's ``Zygote``, which imported it once: the same server, seconds
    sooner. ``fork=False`` runs the command itself."""

    def __init__(self, args: Sequence[str], log_path: Path, metrics_key: str | None = None,
                 wrapper: Sequence[str] = (), fork: bool = True) -> None:
        self.port = free_port()
        self.metrics_headers = {"Authorization": f"Bearer {metrics_key}"} if metrics_key else {}
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        command = [*wrapper, sys.executable, "-m", "prefixserve", "serve", "--host", "127.0.0.1",
                   "--port", str(self.port), "--disable-access-log", *args]
        forked = None if wrapper or not fork or "--replicas" in args else _fork_server(
            command[3:], log_path)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process: subprocess.Popen[bytes] | ForkedServer = forked or subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start(self, timeout: float = STARTUP_TIMEOUT) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n"
                                   f"{self.log}")
            try:
                if HTTP.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server did not come up in {timeout} s:\n{self.log}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit status (SIGKILL and -9 if it does not exit in time)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def samples(self) -> list[Sample]:
        """Every sample of ``/metrics``, with all its labels."""
        response = HTTP.get(self.url + "/metrics", headers=self.metrics_headers, timeout=10)
        response.raise_for_status()
        text = response.text
        return [s for family in text_string_to_metric_families(text) for s in family.samples]

    def metrics(self) -> dict[str, float]:
        """Every sample of ``/metrics`` by name, labels but ``model_name`` (which every sample
        has) appended as ``name{k=v,...}``."""
        samples = {}
        for sample in self.samples():
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if k != "model_name")
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return samples

    def wait_for_metrics(self, condition: Callable[[dict[str, float]], bool],
                         timeout: float = 30.0) -> dict[str, float]:
        """Polls ``/metrics`` until ``condition`` holds; fails with the last sample if never."""
        deadline = time.monotonic() + timeout
        while True:
            samples = self.metrics()
            if condition(samples):
                return samples
            if time.monotonic() > deadline:
                raise AssertionError(f"metrics condition not met in {timeout} s: "
                                     f"{ {k: v for k, v in samples.items() if 'bucket' not in k} }")
            time.sleep(0.1)


def idle(samples: dict[str, float]) -> bool:
    """No request running or waiting and no KV block held."""
    return (samples["prefixserve:num_requests_running"] == 0
            and samples["prefixserve:num_requests_waiting"] == 0
            and samples["prefixserve:kv_cache_usage_perc"] == 0
            and samples["prefixserve:kv_cache_num_free_blocks"]
            == samples["prefixserve:kv_cache_num_blocks"])


def serve_for_module(args: Sequence[str], log_path: Path) -> Iterator[ServerProcess]:
    """The body of a module-scoped server fixture (``yield from`` it): starts the server, and
    after the module's tests checks that it stopped cleanly and never logged a traceback."""
    process = ServerProcess(args, log_path).start()
    yield process
    assert process.stop() == 0, process.log
    assert "Traceback" not in process.log, process.log


def openai_client(server: ServerProcess, timeout: float = 600) -> openai.OpenAI:
    """The official client on ``server`` (no retries: a failure shows at once)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=timeout)


def serve_all(processes: dict[str, ServerProcess]) -> Iterator[dict[str, ServerProcess]]:
    """The body of a fixture that runs several servers side by side (``yield from`` it):
    starts them all, and stops them all afterwards, even when a start failed."""
    try:
        for process in processes.values():
            process.start()
        yield processes
    finally:
        for process in processes.values():
            process.stop()


def small_filesystem(path: Path, size: str) -> list[str] | None:
    """A command prefix that runs its arguments with a fresh tmpfs of ``size`` mounted on
    ``path``, in a mount namespace of their own (an unprivileged user namespace where the kernel
    allows one, else root's), so nothing stays mounted after; None where neither is allowed."""
    if shutil.which("unshare") is None:
        return None
    script = f'mount -t tmpfs -o size={size} tmpfs "$0" && exec "$@"'
    for unshare in (["unshare", "--user", "--map-root-user", "--mount"], ["unshare", "--mount"]):
        command = [*unshare, "sh", "-c", script, str(path)]
        if subprocess.run([*command, "true"], capture_output=True).returncode == 0:
            return command
    return None


def remount(pid: int, path: Path, mode: str) -> None:
    """Remounts the tmpfs on ``path`` (``ro`` or ``rw``) in process ``pid``'s mount namespace
    (one ``small_filesystem`` made)."""
    for enter in (["nsenter", "-t", str(pid), "-m"],
                  ["nsenter", "-t", str(pid), "-U", "-m", "--preserve-credentials"]):
        done = subprocess.run([*enter, "mount", "-o", f"remount,{mode}", str(path)],
                              capture_output=True, text=True)
        if done.returncode == 0:
            return
    raise AssertionError(f"could not remount {path} {mode}: {done.stderr}")
