"""Which of the waiting items form the next batch (the batcher's window, inferd/replica/batcher.py)."""
from typing import Protocol, TypeVar


class Costed(Protocol):
    cost: int
    seq: int  # arrival order


C = TypeVar("C", bound=Costed)


def pick(window: list[C], max_items: int, max_cost: int, by_cost: bool) -> list[C]:
    """Items of window for a batch with room for max_items and max_cost; the window's first (oldest) item is
    always among them. Unsorted: the window's order, up to the first item that does not fit. by_cost: the
    window sorted by cost and the batch grown from the oldest item, one neighbour at a time, taking the one
    that adds less padding: a cheaper one is padded up to the batch's top cost, a costlier one pads every item
    taken so far up to its own."""
    if not window or max_items < 1 or window[0].cost > max_cost:
        return []
    if not by_cost:
        taken, cost = [], 0
        for item in window[:max_items]:
            if cost + item.cost > max_cost:
                break
            taken, cost = taken + [item], cost + item.cost
        return taken
    ordered = sorted(window, key=lambda i: (i.cost, i.seq))
    lo = ordered.index(window[0])
    hi, cost, top = lo + 1, window[0].cost, window[0].cost
    while hi - lo < max_items:
        left = ordered[lo - 1] if lo > 0 and cost + ordered[lo - 1].cost <= max_cost else None
        right = ordered[hi] if hi < len(ordered) and cost + ordered[hi].cost <= max_cost else None
        if left is None and right is None:
            break
        if right is None or left is not None and top - left.cost <= (right.cost - top) * (hi - lo):
            lo, cost = lo - 1, cost + left.cost
        else:
            hi, cost, top = hi + 1, cost + right.cost, right.cost
    return ordered[lo:hi]
