"""`vlenvoys serve` (or any HTTP server command) in a process of its own, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

__all__ = ["ServerProcess", "http_server", "server"]


@contextlib.contextmanager
def server(
    model: str | os.PathLike, log: str | os.PathLike, *arguments: str, started_within: float = 300
) -> Iterator[dict]:
    """``vlenvoys serve MODEL ARGUMENTS`` on a free loopback port, for the ``with`` body (see `http_server`)."""
    command = [sys.executable, "-c", "from vlenvoys.cli import app; app()", "serve", str(model), *arguments]
    with http_server(command, log, started_within) as started:
        yield started


@contextlib.contextmanager
def http_server(command: list[str], log: str | os.PathLike, started_within: float = 300) -> Iterator[dict]:
    """``command --host 127.0.0.1 --port PORT`` (a free port) in a process group of its own, for the ``with`` body.

    Yields ``{"url": "http://127.0.0.1:PORT", "pid": ..., "log": Path}``
    once ``/health`` answers; the server's output goes to ``log``. On exit
    the group (server and engine processes) gets SIGINT, then SIGKILL after 60 s.

    Raises:
        RuntimeError: the server exited, or did not answer within ``started_within`` seconds
            (with the end of its log).
    """
    process = ServerProcess(command, log)
    try:
        process.wait_ready(started_within)
        yield {"url": process.url, "pid": process.process.pid, "log": process.log}
    finally:
        process.stop()


class ServerProcess:
    """``command --host 127.0.0.1 --port PORT`` started now, in a process group of its own, output to ``log``.

    For several servers starting side by side (the speed gate's): start each,
    then `wait_ready` for each; `stop` ends the group (SIGINT, SIGKILL after 60 s).
    """

    def __init__(self, command: list[str], log: str | os.PathLike) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.command, self.log, self.url = command, pathlib.Path(log), f"http://127.0.0.1:{port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(self.log, "w") as output:
            self.process = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)], stdout=output,
                                            stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, started_within: float = 300) -> str:
        """Wait until ``/health`` answers; returns the server's URL.

        Raises:
            RuntimeError: the server exited, or did not answer within ``started_within`` seconds (with the end
                of its log).
        """
        deadline = time.monotonic() + started_within
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.command[:5]} exited ({self.process.returncode}):\n{self._log_end()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self.url
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.command[:5]} did not start within {started_within} s:\n{self._log_end()}")
            time.sleep(1)

    def _log_end(self) -> str:
        return self.log.read_text()[-4000:]

    def stop(self) -> None:
        """SIGINT to the server's process group, SIGKILL if it has not exited 60 s later."""
        try:  # the group also holds the engine's processes, which may outlive a server that exited
            os.killpg(self.process.pid, signal.SIGINT)
        except ProcessLookupError:
            return
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
