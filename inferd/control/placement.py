"""Where a replica runs: a local process (default) or a Ray actor (placement.backend: ray)."""
from inferd.control.replicas import ReplicaHandle, ReplicaProcess
from inferd.control.spec import PlacementSpec


def make_replica(placement: PlacementSpec | None, args: list[str]) -> ReplicaHandle:
    """A not yet started replica of `inferd replica ARGS` placed as the spec says."""
    if placement is None or placement.backend == "local":
        return ReplicaProcess(args)
    if placement.backend == "ray":  # ray itself is imported only when the replica starts
        from inferd.control.ray_placement import RayReplica
        return RayReplica(args, placement)
    raise ValueError(f"placement backend {placement.backend!r} is not available")
