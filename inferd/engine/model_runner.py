from collections.abc import Callable
from dataclasses import dataclass

import torch

from inferd.engine.block_manager import BlockManager
from inferd.engine.scheduler import Batch
from inferd.engine.sequence import Sequence
from inferd.models.config import ModelConfig
from inferd.models.llama import AttentionMetadata, LlamaForCausalLM, PrefillChunk


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize


@dataclass(slots=True)
class Chunk:
    """Tokens of one sequence computed in one forward, from position `start`, into its blocks' slots."""
    seq: Sequence
    start: int
    token_ids: list[int]
    num_logits: int  # logits after each of the last num_logits tokens (0: none)


class ModelRunner:
    """Turns a scheduled batch into the model's inputs and runs one forward.

    kv_cache: [layers, 2, slots] with one slot per token of the block pool, so the block manager's tables
    index it; allocated here unless given (a layer-skip draft reads and writes the target's first layers)."""

    def __init__(self, model: LlamaForCausalLM, blocks: BlockManager, dtype: torch.dtype,
                 kv_cache: torch.Tensor | None = None):
        c = model.config
        self.model = model
        self.blocks = blocks
        num_slots = blocks.num_blocks * blocks.block_size
        if kv_cache is None:
            kv_cache = torch.zeros(c.num_layers, 2, num_slots, c.num_kv_heads, c.head_dim, dtype=dtype)
        assert kv_cache.shape == (c.num_layers, 2, num_slots, c.num_kv_heads, c.head_dim)
        self.kv_cache = kv_cache

    def run(self, batch: Batch, between: Callable[[], None] | None = None) -> torch.Tensor:
        """Returns fp32 logits: each scheduled sequence's ScheduledSeq.num_logits rows (its prompt logprobs', then
        one to sample or 1 + k to verify k drafts), in batch order. between: as the model's forward takes it."""
        def chunk(item):
            start = item.seq.num_computed_tokens
            return Chunk(item.seq, start, item.seq.token_ids[start:start + item.num_tokens], item.num_logits)
        return self.forward([chunk(i) for i in batch.decodes], [chunk(i) for i in batch.prefills], between)

    def forward(self, decodes: list[Chunk], prefills: list[Chunk], between: Callable[[], None] | None = None
                ) -> torch.Tensor:
        """decodes: one token each, attended to together; prefills: any number of tokens each.
        Returns fp32 logits: the rows each chunk asks for, decodes first, in order."""
        assert all(len(c.token_ids) == 1 for c in decodes)
        input_ids, positions, slots, logits_rows = [], [], [], []
        for c in decodes + prefills:
            input_ids += c.token_ids
            positions += range(c.start, c.start + len(c.token_ids))
            slots += (self.blocks.slot(c.seq, p) for p in range(c.start, c.start + len(c.token_ids)))
            logits_rows += range(len(input_ids) - c.num_logits, len(input_ids))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            num_decode_tokens=len(decodes),
            block_size=self.blocks.block_size,
            decode_blocks=None, decode_lens=None,
            prefills=self._prefill_chunks(prefills, len(decodes)))
        if decodes:
            meta.decode_blocks, meta.decode_lens = self._decode_context(decodes)
        return self.model(torch.tensor(input_ids), torch.tensor(positions), meta, self.kv_cache,
                          torch.tensor(logits_rows, dtype=torch.long), between)

    def _prefill_chunks(self, prefills: list[Chunk], row: int) -> list[PrefillChunk]:
        chunks = []
        for c in prefills:
            ctx = c.start + len(c.token_ids)
            blocks = torch.tensor(c.seq.block_table[:-(-ctx // self.blocks.block_size)])
            chunks.append(PrefillChunk(row, len(c.token_ids), blocks, ctx))
            row += len(c.token_ids)
        return chunks

    def _decode_context(self, decodes: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded block tables of the decodes and their context lengths."""
        bs = self.blocks.block_size
        lengths = [c.start + 1 for c in decodes]
        width = -(-max(lengths) // bs)
        table = torch.tensor([c.seq.block_table[:width] + [0] * (width - len(c.seq.block_table[:width]))
                              for c in decodes])
        return table, torch.tensor(lengths)
