"""Where a request runs: filter replicas, score prefix-cache affinity against load, pick one."""
