"""Starts test servers without importing the server again for each: ``python server_zygote.py``.

A ``prefixserve serve`` process spends most of its start importing (torch, the server; 4-7 s
on 2 cores, where loading the default model and warming up take ~1 s), and the suite starts
a server about 25 times. This program imports the server once and then, for each request read
from its standard input (one JSON object a line: ``argv``, ``log``, ``cwd``, ``env``), forks a
child that becomes the server: its output goes to ``log``, its environment and working folder
are the request's, and it runs ``prefixserve.cli.main(argv)`` as ``python -m prefixserve``
would, exiting with its status. The server's work (model load, engine, HTTP) all happens in the
child, after the fork; only modules were loaded before it, and no torch thread pool runs in
this process (torch's intra-op pool starts at the first parallel operation, here the child's).

It writes one line a child to its standard output: ``started PID`` once a child is forked,
``exited PID STATUS`` once it has ended (status as ``subprocess.Popen.returncode`` gives it).
At the end of its input it stops its living children (SIGTERM) and exits.

``tests/server_helpers.py`` uses it where a server's environment is the one this program
started with (``ServerProcess``); ``PREFIXSERVE_TEST_FORK=0`` turns it off for the whole run.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import sys
from typing import Any

import prefixserve.cli
import prefixserve.server.app  # the import that forking spares each server

POLL_S = 0.05
"""How often ended children are looked for while no request comes."""


def _report(line: str) -> None:
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def _become_server(request: dict[str, Any]) -> int:
    """In the forked child: the request's output, folder and environment; then the server."""
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["prefixserve", *request["argv"]]
    return prefixserve.cli.main(request["argv"])


def _reap(children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _report(f"exited {pid} {os.waitstatus_to_exitcode(status)}")


def main() -> int:
    children: set[int] = set()
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    pending = b""
    while True:
        _reap(children)
        if not selector.select(POLL_S):
            continue
        data = os.read(0, 1 << 16)
        if not data:
            break
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            pid = os.fork()
            if pid == 0:
                selector.close()
                return _become_server(json.loads(line))  # the child leaves the loop
            children.add(pid)
            _report(f"started {pid}")
    for pid in children:
        os.kill(pid, signal.SIGTERM)
    return 0


if __name__ == "__main__":
    sys.exit(main())
