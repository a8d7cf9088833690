import hashlib
from array import array
from collections import deque
from dataclasses import dataclass

from inferd.engine.sequence import Sequence

ROOT_HASH = bytes(32)
PUBLIC_NAMESPACE = b"p"  # tenant namespaces are b"t" + name, so no tenant can name this one


def block_hash(namespace: bytes, parent: bytes, token_ids: list[int]) -> bytes:
    """Content address of one full block: its namespace, everything before it (parent) and its tokens."""
    return hashlib.sha256(len(namespace).to_bytes(4, "little") + namespace + parent +
                          array("q", token_ids).tobytes()).digest()


def tenant_namespace(name: str) -> bytes:
    return b"t" + name.encode()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set while the block is in the prefix cache


class BlockManager:
    """Hands out fixed-size KV blocks from a preallocated pool, and caches full blocks by content.

    A block is referenced by every sequence whose block table holds it. A full,
    computed block is registered under its hash; once unreferenced it stays
    cached (evictable) until the pool needs it, least recently released first.
    Never-cached free blocks are handed out before any cached one is evicted.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: deque[int] = deque(range(num_blocks))  # unreferenced, not cached
        self.evictable: dict[int, None] = {}  # unreferenced, cached; insertion order = LRU first
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    # ---- prefix cache

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of seq; never its last token, which must be computed."""
        if not self.enable_caching:
            return []
        hits = []
        for h in self._hashes(seq, (len(seq) - 1) // self.block_size):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Registers the blocks of seq that are full and computed; call after each step that computed them."""
        num_full = seq.num_computed_tokens // self.block_size
        if not self.enable_caching or num_full <= seq.num_offered_blocks:
            return
        hashes = self._hashes(seq, num_full)
        for i in range(seq.num_offered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            assert block.hash in (None, hashes[i]), "a block holds other tokens than its hash says"
            if block.hash is None and hashes[i] not in self.cached:
                block.hash = hashes[i]
                self.cached[hashes[i]] = block.block_id
        seq.num_offered_blocks = num_full

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The first num_blocks block hashes of seq, computed once per sequence (its tokens only grow)."""
        bs, hashes = self.block_size, seq.block_hashes
        for i in range(len(hashes), num_blocks):
            public = (i + 1) * bs <= seq.num_public_tokens
            namespace = PUBLIC_NAMESPACE if public else tenant_namespace(seq.cache_namespace)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(block_hash(namespace, parent, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes[:num_blocks]

    # ---- allocation

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that `num_tokens` tokens of `seq` have a slot."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        n = self.blocks_needed(seq, num_tokens)
        assert n <= self.num_free_blocks, "allocate without can_allocate"
        seq.block_table.extend(self._take() for _ in range(n))

    def can_admit(self, seq: Sequence, num_tokens: int, prefix: list[int]) -> bool:
        """can_allocate for a sequence without blocks that first shares `prefix` (from cached_prefix)."""
        reused = sum(self.blocks[b].ref_count == 0 for b in prefix)  # cached but free: they leave the free pool
        return self.blocks_needed(seq, num_tokens) - len(prefix) + reused <= self.num_free_blocks

    def admit(self, seq: Sequence, num_tokens: int, prefix: list[int]) -> None:
        """Starts seq on `prefix`, computed already, with slots for its first num_tokens tokens."""
        assert not seq.block_table and self.can_admit(seq, num_tokens, prefix), "admit without can_admit"
        self._share(seq, prefix)
        self.allocate(seq, num_tokens)
        if self.enable_caching:
            self.num_query_tokens += len(seq)
            self.num_hit_tokens += len(prefix) * self.block_size

    def _share(self, seq: Sequence, prefix: list[int]) -> None:
        for block_id in prefix:
            block = self.blocks[block_id]
            assert block.hash is not None, "sharing a block that is not cached"
            if block.ref_count == 0:
                del self.evictable[block_id]
            block.ref_count += 1
        seq.block_table.extend(prefix)
        seq.num_offered_blocks = len(prefix)

    def _take(self) -> int:
        if self.free_blocks:
            block = self.blocks[self.free_blocks.popleft()]
        else:
            block = self.blocks[next(iter(self.evictable))]
            del self.evictable[block.block_id], self.cached[block.hash]
            block.hash = None
            self.num_evictions += 1
        assert block.ref_count == 0
        block.ref_count = 1
        return block.block_id

    def free(self, seq: Sequence) -> None:
        """Drops seq's references; its tail blocks go first in LRU order, so a shared head outlives them."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, "freeing an unreferenced block"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self.free_blocks.append(block_id)
                else:
                    self.evictable[block_id] = None
        seq.block_table.clear()
        seq.num_offered_blocks = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
