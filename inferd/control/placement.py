"""Where a replica runs: a local process (default) or a Ray actor (placement.backend: ray); in the gateway's
process (in_process) is control/in_process.py's."""
from collections.abc import Callable

from inferd.control.replicas import ReplicaHandle, ReplicaProcess
from inferd.control.spec import PlacementSpec


def make_replica(placement: PlacementSpec | None, args: list[str],
                 runtime: Callable[[], ReplicaHandle] | None = None, cpus: list[int] | None = None) -> ReplicaHandle:
    """A not yet started replica of `inferd replica ARGS`, or of runtime() (a RuntimeProcess: runtime.engine vllm
    or llama.cpp, its CPUs its own), placed as the spec says; a local process on cpus (None: all of the
    machine's)."""
    if placement is None or placement.backend == "local":
        return runtime() if runtime is not None else ReplicaProcess(args, cpus)
    if placement.backend == "ray":  # ray itself is imported only when the replica starts
        from inferd.control.ray_placement import RayReplica
        return RayReplica(args, placement, runtime() if runtime is not None else None)
    raise ValueError(f"placement backend {placement.backend!r} is not available")
