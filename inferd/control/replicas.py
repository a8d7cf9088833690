"""Local replica processes: start `inferd replica`, wait for readiness (a real inference), stop."""
import ctypes
import functools
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from inferd.control.cpus import machine_cpus

log = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """Linux: the replica gets SIGTERM if `inferd serve` dies without stopping it (no orphan engines)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def in_child(cpus: list[int]) -> None:
    """A replica's process before it runs its command: it dies with its parent and runs on these CPUs (set even
    when they are all of the machine's: a child inherits the affinity of the gateway, which may have pinned
    itself to its own share)."""
    _die_with_parent()
    os.sched_setaffinity(0, cpus)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ReplicaHandle(Protocol):
    """One replica wherever it is placed (a local process, a Ray actor): what the control plane needs of it."""
    url: str  # its OpenAI-compatible base URL (without /v1)
    api_key: str

    def start(self) -> None: ...
    def wait_ready(self, timeout_s: float = 900.0) -> None: ...  # raises if it dies or times out
    def alive(self) -> bool: ...  # False once its process (or actor) has exited
    def stop(self, timeout_s: float = 15.0) -> None: ...


def wait_until_ready(url: str, alive: Callable[[], bool], how_it_ended: Callable[[], str], timeout_s: float) -> None:
    """Until url's /ready answers 200 (the replica ran a real one-token inference); raises if it ends first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"replica on {url} {how_it_ended()} before it was ready")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"replica on {url} not ready after {timeout_s:.0f} s")


@dataclass(slots=True, eq=False)
class ReplicaProcess:
    """One `inferd replica` child on a loopback port, reachable only with its own random key."""
    args: list[str]  # model and engine flags for `inferd replica`
    cpus: list[int] | None = None  # the CPUs it runs on (control/cpus.py); None: all of the machine's
    host: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    api_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "inferd.cli", "replica", *self.args, "--host", self.host, "--port", str(self.port)]
        env = os.environ | {"INFERD_API_KEY": self.api_key}
        self.proc = subprocess.Popen(cmd, env=env, preexec_fn=functools.partial(in_child, self.cpus or machine_cpus()))
        log.info("started replica pid %d on %s", self.proc.pid, self.url)

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        wait_until_ready(self.url, self.alive, lambda: f"exited with {self.proc.returncode}", timeout_s)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc is not None:
            terminate(self.proc, timeout_s)


def terminate(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (the replica finishes its shutdown), SIGKILL if it takes longer than timeout_s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
