import random
from dataclasses import dataclass

import pytest

from inferd.router.prefix_index import PrefixIndex, prefix_hashes
from inferd.router.router import POLICIES, Router, RouterConfig


@dataclass(eq=False)
class Replica:
    name: str
    healthy: bool = True
    draining: bool = False
    inflight: int = 0
    inflight_tokens: int = 0


def doc(seed: int, n: int = 160) -> list[int]:
    return random.Random(seed).sample(range(1000, 50000), n)


def test_prefix_hashes_chain_and_namespace():
    a = prefix_hashes("t1", doc(1) + [1, 2, 3], 16)
    assert a == prefix_hashes("t1", doc(1) + [9, 9], 16) and len(a) == 10
    assert prefix_hashes("t2", doc(1), 16)[0] != a[0]
    assert prefix_hashes("t1", doc(2)[:16] + doc(1)[16:], 16)[1] != a[1]  # a block's hash depends on its parents


def test_index_is_bounded_lru():
    index = PrefixIndex(max_blocks=15)
    old, new = prefix_hashes("t", doc(1), 16), prefix_hashes("t", doc(2), 16)
    index.add("r0", old)
    index.add("r0", new)
    assert index.matched("r0", new) == 10 and index.matched("r0", old) == 0  # oldest evicted first
    assert index.matched("r1", new) == 0


def test_prefix_policy_follows_the_document():
    replicas = [Replica("r0"), Replica("r1")]
    router = Router(RouterConfig("prefix"), random.Random(0))
    first = router.pick(replicas, doc(1) + [5], "t")
    first.inflight += 1  # busier now, but it holds the prefix
    assert router.pick(replicas, doc(1) + [6, 7], "t") is first
    assert router.index.matched(first.name, prefix_hashes("u", doc(1), 16)) == 0  # no affinity across tenants


def test_load_outweighs_a_small_affinity():
    replicas = [Replica("r0"), Replica("r1")]
    router = Router(RouterConfig("prefix", affinity_weight=1.0, load_weight=1.0), random.Random(0))
    router.index.add("r0", prefix_hashes("t", doc(1), 16)[:1])  # 1 of 10 blocks
    replicas[0].inflight, replicas[0].inflight_tokens = 8, 4000
    assert router.pick(replicas, doc(1), "t").name == "r1"


def test_a_draining_replica_gets_no_new_requests():
    replicas = [Replica("r0", draining=True), Replica("r1", inflight=5)]
    for policy in POLICIES:
        router = Router(RouterConfig(policy=policy))
        assert {router.pick(replicas, [1] * 64, "t").name for _ in range(8)} == {"r1"}, policy


def test_unhealthy_replicas_are_skipped_and_other_policies():
    replicas = [Replica("r0", healthy=False), Replica("r1"), Replica("r2", inflight=3, inflight_tokens=100)]
    assert Router(RouterConfig("least_loaded")).pick(replicas, [1], "t").name == "r1"
    rr = Router(RouterConfig("round_robin"))
    assert [rr.pick(replicas, [1], "t").name for _ in range(4)] == ["r1", "r2", "r1", "r2"]
    with pytest.raises(ValueError, match="policy"):
        RouterConfig("random")
