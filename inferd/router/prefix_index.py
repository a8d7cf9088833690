"""A router-side index of the prompt-prefix blocks recently routed to each replica, bounded (LRU)."""
import hashlib
from collections import OrderedDict


def prefix_hashes(namespace: str, token_ids: list[int], block_size: int) -> list[bytes]:
    """Chained hashes of the prompt's full blocks: equal prefixes (in one namespace) give equal leading hashes."""
    parent, out = namespace.encode(), []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = b"".join(t.to_bytes(4, "little") for t in token_ids[start:start + block_size])
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(parent)
    return out


class PrefixIndex:
    """For each replica, the block hashes routed to it most recently; at most max_blocks per replica."""

    def __init__(self, max_blocks: int = 65_536):
        self.max_blocks = max_blocks
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def matched(self, replica: str, hashes: list[bytes]) -> int:
        """How many leading blocks of the prompt this replica was last sent (likely still in its cache)."""
        seen = self._blocks.get(replica)
        if not seen:
            return 0
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def add(self, replica: str, hashes: list[bytes]) -> None:
        seen = self._blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)

    def forget(self, replica: str) -> None:
        self._blocks.pop(replica, None)
