"""Which CPUs each local replica and the gateway run on: a deployment's `placement.cpus`, "auto" or a cpulist.

Each replica process is pinned to its CPUs (its affinity, set as it starts: replicas.in_child); the engines run on
the cores they get, and on fewer while other processes use them (inferd/models/cores.py). What "auto" gives:

- on fewer than MIN_CPUS_TO_SPLIT CPUs, nothing is pinned: every replica and the gateway share all of them;
- else the gateway gets the first CPU, and the kinds not in WEIGHTS (classical, policy) share it with the gateway;
  the text and embedding deployments split the other CPUs in contiguous ranges, in proportion to their WEIGHTS,
  at least one each (with fewer CPUs than such deployments, they all share those CPUs).

A cpulist is honoured as given, and its CPUs are taken out of what the "auto" deployments get (none left: they
share all of the machine's, and the gateway is not pinned; nor is it without local replicas). The replicas of one
deployment share its CPUs. docs/cpus.md has the tables.
"""
import functools
import os
import re
from dataclasses import dataclass

AUTO = "auto"
MIN_CPUS_TO_SPLIT = 4  # on fewer, a replica that runs alone would lose half its cores; adaptive threads share them
# CPUs in proportion: a text replica reads every weight for each token it decodes, an embedding one small forward
# pass per batch; the kinds not named here run one thread each and share the gateway's CPU
WEIGHTS = {"text": 3, "embedding": 1}

_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")


@functools.cache
def machine_cpus() -> list[int]:
    """The CPUs inferd may use here: the affinity of the process that started, read once (before the gateway
    pins itself to its share, which the replicas it starts would otherwise inherit)."""
    return sorted(os.sched_getaffinity(0))


def parse_cpulist(text: str) -> list[int]:
    """A Linux cpulist ("0-3,6", as taskset -c and /proc/PID/status write it) as sorted CPU numbers."""
    cpus: set[int] = set()
    for part in text.split(","):
        m = _RANGE.fullmatch(part.strip())
        if m is None:
            raise ValueError(f"{text!r} is not a CPU list such as 0-3,6")
        first, last = int(m[1]), int(m[2] or m[1])
        if first > last:
            raise ValueError(f"{part.strip()!r} is an empty range")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def cpulist(cpus: list[int]) -> str:
    """Sorted CPU numbers as a cpulist: [0, 1, 2, 3, 6] -> "0-3,6"."""
    parts: list[str] = []
    for i, c in enumerate(cpus):
        if i and c == cpus[i - 1] + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{c}"
        else:
            parts.append(str(c))
    return ",".join(parts)


@dataclass(frozen=True, slots=True)
class Shares:
    gateway: list[int] | None  # None: not pinned
    deployments: dict[str, list[int] | None]  # by name, in the order given; None: all of the machine's CPUs


def allocate(machine: list[int], deployments: list[tuple[str, str, str]]) -> Shares:
    """Each deployment's CPUs on a machine of these CPUs (sorted), and the gateway's. A deployment is (name, kind,
    cpus): its cpus setting is "auto" or a cpulist."""
    out: dict[str, list[int] | None] = {name: parse_cpulist(cpus) for name, _, cpus in deployments if cpus != AUTO}
    taken = {c for cpus in out.values() for c in cpus}
    free = [c for c in machine if c not in taken]
    auto = [(name, kind) for name, kind, cpus in deployments if cpus == AUTO]
    gateway = None
    if len(machine) < MIN_CPUS_TO_SPLIT or not free or not deployments:  # none: nothing to keep off its CPU
        out |= {name: None for name, _ in auto}
    else:
        gateway, rest = free[:1], free[1:]
        out |= {name: gateway for name, kind in auto if kind not in WEIGHTS}
        out |= split(rest or gateway, [(name, WEIGHTS[kind]) for name, kind in auto if kind in WEIGHTS])
    return Shares(gateway, {name: out[name] for name, _, _ in deployments})


def split(cpus: list[int], weights: list[tuple[str, int]]) -> dict[str, list[int]]:
    """CPUs in contiguous ranges, one per name in the order given, in proportion to its weight, at least one each;
    with fewer CPUs than names, every name shares them all."""
    if not weights or len(cpus) < len(weights):
        return {name: cpus for name, _ in weights}
    total, counts = sum(w for _, w in weights), [1] * len(weights)
    for _ in range(len(cpus) - len(weights)):  # each next CPU to the name furthest below its proportion
        i = max(range(len(weights)), key=lambda i: weights[i][1] * len(cpus) / total - counts[i])
        counts[i] += 1
    out, start = {}, 0
    for (name, _), n in zip(weights, counts):
        out[name], start = cpus[start:start + n], start + n
    return out

