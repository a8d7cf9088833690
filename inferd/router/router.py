"""Replica choice: prefix-cache affinity weighed against load, counted at pick time.

score = affinity_weight * (matched prefix blocks / prompt blocks) - load_weight * load
load  = (in-flight requests - fewest) / load_scale_requests + (in-flight tokens - fewest) / load_scale_tokens
so a replica holding the prompt's prefix keeps it until it is busier than the others by about a
load_scale of requests (or tokens). With no affinity signal anywhere, two random candidates are drawn
and the less loaded wins (power of two choices).
"""
import itertools
import random
from dataclasses import dataclass
from typing import Protocol

from inferd.router.prefix_index import PrefixIndex, prefix_hashes

POLICIES = ("prefix", "least_loaded", "round_robin")


class Replica(Protocol):
    name: str
    healthy: bool
    draining: bool  # being let go: no new requests
    inflight: int
    inflight_tokens: int


@dataclass(slots=True)
class RouterConfig:
    policy: str = "prefix"
    affinity_weight: float = 1.0
    load_weight: float = 1.0
    load_scale_requests: int = 8  # this many more in-flight requests than the idlest replica weigh 1.0
    load_scale_tokens: int = 16_384  # likewise in reserved tokens
    block_size: int = 16  # the replicas' KV block size: the prefix cache holds whole blocks
    max_index_blocks: int = 65_536  # per replica

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")


class Router:
    def __init__(self, config: RouterConfig | None = None, rng: random.Random | None = None):
        self.config = config or RouterConfig()
        self.index = PrefixIndex(self.config.max_index_blocks)
        self._rng = rng or random.Random()
        self._turn = itertools.count()

    def pick(self, replicas: list[Replica], prompt_ids: list[int], namespace: str) -> Replica:
        serving = [r for r in replicas if not r.draining] or replicas  # draining: no new work
        candidates = [r for r in serving if r.healthy] or serving
        policy = self.config.policy
        if policy == "round_robin":
            chosen = candidates[next(self._turn) % len(candidates)]
        elif policy == "least_loaded":
            chosen = min(candidates, key=lambda r: self._load(r, candidates))
        else:
            hashes = prefix_hashes(namespace, prompt_ids, self.config.block_size)
            chosen = self._by_affinity(candidates, hashes)
            self.index.add(chosen.name, hashes)
        return chosen

    def _by_affinity(self, candidates: list[Replica], hashes: list[bytes]) -> Replica:
        matched = {r.name: self.index.matched(r.name, hashes) for r in candidates}
        if not hashes or not any(matched.values()):
            pair = self._rng.sample(candidates, min(2, len(candidates)))
            return min(pair, key=lambda r: self._load(r, candidates))
        c = self.config
        return max(candidates, key=lambda r: c.affinity_weight * matched[r.name] / len(hashes)
                   - c.load_weight * self._load(r, candidates))

    def _load(self, replica: Replica, candidates: list[Replica]) -> float:
        c = self.config
        requests = replica.inflight - min(r.inflight for r in candidates)
        tokens = replica.inflight_tokens - min(r.inflight_tokens for r in candidates)
        return requests / c.load_scale_requests + tokens / c.load_scale_tokens
