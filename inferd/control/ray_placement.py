"""Ray placement: a replica as a Ray actor that runs `inferd replica` (or, for runtime.engine vllm or llama.cpp,
that runtime's server, as a RuntimeProcess builds it) as its child process on its node.

The actor reserves the deployment's num_cpus/num_gpus on a node of the cluster (placement.ray_address, else
$RAY_ADDRESS, else a new local cluster). Its child listens on the node's IP with a random key of its own, as a
local ReplicaProcess does on loopback. The driver (`inferd serve`) ships its own `inferd` package to the workers
(runtime_env py_modules), so every node runs the driver's code with the Python that node's Ray runs on.
"""
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


import inferd
from inferd.control.replicas import free_port, terminate, wait_until_ready
from inferd.control.spec import PlacementSpec

log = logging.getLogger(__name__)
NAMESPACE = "inferd"  # the actors are named inferd-replica-<hex> in it
_lock = threading.Lock()
_joined: str | None = None  # the one cluster this process joined
# runs ARGV[2:] (a program and its arguments) with SIGTERM on its parent's death (set here: preexec_fn is unsafe
# in Ray's threaded worker)
_EXEC_WITH_PDEATHSIG = ("import ctypes, os, signal, sys; ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM); "
                        "os.getppid() == int(sys.argv[1]) or sys.exit('parent gone'); "
                        "os.execv(sys.argv[2], sys.argv[2:])")


def _ray() -> Any:
    factory = logging.getLogRecordFactory()
    try:
        import ray
    except ImportError:
        raise RuntimeError("placement backend 'ray' needs the ray package: pip install 'inferd[ray]'") from None
    logging.setLogRecordFactory(factory)  # importing ray adds _ray_timestamp_ns to every record (and our JSON logs)
    return ray


def connect(address: str | None) -> Any:
    """ray.init once per process: ADDRESS, else $RAY_ADDRESS, else a new local cluster; returns the ray module."""
    global _joined
    ray = _ray()
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    with _lock:
        if _joined not in (None, address):
            raise RuntimeError(f"one inferd serve joins one Ray cluster, not both {_joined} and {address}")
        if not ray.is_initialized():
            try:
                ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING,
                         runtime_env={"py_modules": [str(Path(inferd.__file__).parent)]})
            except (ConnectionError, ValueError) as exc:
                raise RuntimeError(f"cannot join the Ray cluster at {address}: {exc}") from None
            _joined = address
    return ray


class ReplicaActor:
    """In a Ray worker on the chosen node: owns the replica's child (it gets SIGTERM if the worker dies)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.runtime: Any = None  # the RuntimeProcess whose server the child is

    def launch(self, args: list[str], port: int | None, api_key: str, runtime: Any = None) -> tuple[str, int, str]:
        """Starts the child on PORT if it is free here (a restart keeps its URL), else on a free port: `inferd
        replica ARGS`, or runtime's server (its command built here, on this node)."""
        import ray
        host = ray.util.get_node_ip_address()
        port = port if port and _bindable(host, port) else free_port(host)
        wrap = [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid())]
        if runtime is not None:
            runtime.host, runtime.port, runtime.api_key = host, port, api_key
            cmd, env = runtime.command()
            # its own session: its engine core and workers are stopped with it (RuntimeProcess.stop)
            self.proc = runtime.proc = subprocess.Popen(wrap + cmd, env=env, stdout=runtime.stdout,
                                                        start_new_session=True)
            self.runtime = runtime
        else:
            root = str(Path(inferd.__file__).parents[1])  # where this worker imported inferd from
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
            env = os.environ | {"INFERD_API_KEY": api_key, "PYTHONPATH": path}
            cmd = [sys.executable, "-m", "inferd.cli", "replica", *args, "--host", host, "--port", str(port)]
            self.proc = subprocess.Popen(wrap + cmd, env=env)
        return host, port, ray.get_runtime_context().get_node_id()

    def returncode(self) -> int | None:
        return self.proc.poll()

    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float) -> None:
        if self.runtime is not None:
            self.runtime.stop(timeout_s)  # and what is left of its process group, and its config folder
        else:
            terminate(self.proc, timeout_s)


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass(slots=True, eq=False)
class RayReplica:
    """One `inferd replica` (or runtime's server) in a Ray actor, reachable only with its own random key; its url
    is known once start() returns (the node and port the actor got)."""
    args: list[str]  # model and engine flags for `inferd replica`
    placement: PlacementSpec
    runtime: Any = None  # a RuntimeProcess (runtime.engine vllm or llama.cpp) to run there instead
    schedule_timeout_s: float = 120.0  # for the cluster to find the resources; then start() fails saying which
    url: str = ""
    api_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))  # passed in the launch call, not stored
    actor: Any = None
    name: str = ""
    node_id: str | None = None  # a restart asks for the same node and port, so the URL stays the gateway's
    port: int | None = None
    loaded_unix_s: float | None = None  # a runtime's server: when it answered, and its first completion
    warm_unix_s: float | None = None

    def start(self) -> None:
        ray = connect(self.placement.ray_address)
        if self.actor is not None:
            self.stop()
        need = {"CPU": self.placement.num_cpus, "GPU": self.placement.num_gpus}
        need = {k: v for k, v in need.items() if v > 0}
        _check_feasible(ray, need)
        self.name = f"inferd-replica-{secrets.token_hex(6)}"
        options: dict[str, Any] = {"num_cpus": self.placement.num_cpus, "num_gpus": self.placement.num_gpus,
                                   "name": self.name, "namespace": NAMESPACE, "max_restarts": 0}
        if self.node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.node_id, soft=True)
        self.actor = ray.remote(ReplicaActor).options(**options).remote()
        try:
            launched = self.actor.launch.remote(self.args, self.port, self.api_key, self.runtime)
            host, port, self.node_id = ray.get(launched, timeout=self.schedule_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._kill(ray)
            raise RuntimeError(f"Ray placed no replica in {self.schedule_timeout_s:.0f} s: it needs {_fmt(need)}; "
                               f"the cluster has {_fmt(_free(ray))} free") from None
        except ray.exceptions.RayError as exc:
            self._kill(ray)
            raise RuntimeError(f"the Ray actor of a replica failed to start: {exc}") from None
        self.port = port
        self.url = f"http://{host}:{port}"
        if self.runtime is not None:  # the driver's copy: where its server listens, for wait_ready
            self.runtime.host, self.runtime.port, self.runtime.api_key = host, port, self.api_key
        log.info("started replica in Ray actor %s on node %s, %s", self.name, self.node_id[:12], self.url)

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        def how_it_ended() -> str:
            return f"(Ray actor {self.name}) exited"
        if self.runtime is None:
            wait_until_ready(self.url, self.alive, how_it_ended, timeout_s)
            return
        from inferd.control.runtimes import wait_runtime_ready
        self.loaded_unix_s, self.warm_unix_s = wait_runtime_ready(self.runtime, self.alive, how_it_ended, timeout_s)

    def cold_start(self) -> dict:
        """A runtime's server: when its weights were in and its first completion came back (as RuntimeProcess)."""
        return {} if self.runtime is None else {"loaded_unix_s": self.loaded_unix_s, "warm_unix_s": self.warm_unix_s}

    def alive(self) -> bool:
        ray, actor = _ray(), self.actor
        if actor is None:
            return False
        try:
            return ray.get(actor.returncode.remote(), timeout=10) is None
        except ray.exceptions.GetTimeoutError:
            return True  # busy, not known to be gone
        except ray.exceptions.RayError:
            return False  # the actor or its node is gone

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.actor is None:
            return
        ray, actor = _ray(), self.actor
        try:
            ray.get(actor.stop.remote(timeout_s), timeout=timeout_s + 5)
        except ray.exceptions.RayError:
            pass  # gone already: the kill below frees what it held
        self._kill(ray)

    def _kill(self, ray: Any) -> None:
        actor, self.actor = self.actor, None  # a stop() from another thread may have been first
        if actor is not None:
            ray.kill(actor)  # the worker goes, and its child with it (PDEATHSIG)


def _check_feasible(ray: Any, need: dict[str, float]) -> None:
    """Fails at once when no alive node of the cluster could ever hold NEED."""
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    if any(all(r.get(k, 0) >= v for k, v in need.items()) for r in nodes):
        return
    shapes = "; ".join(_fmt({k: r.get(k, 0.0) for k in ("CPU", "GPU")}) for r in nodes) or "none alive"
    raise RuntimeError(f"no node of the Ray cluster has {_fmt(need)} for one replica (placement.num_cpus, "
                       f"num_gpus); its nodes have: {shapes}")


def _free(ray: Any) -> dict[str, float]:
    free = ray.available_resources()
    return {k: free.get(k, 0.0) for k in ("CPU", "GPU")}


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in resources.items())
