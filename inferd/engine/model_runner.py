import torch

from inferd.engine.block_manager import BlockManager
from inferd.engine.scheduler import Batch
from inferd.models.config import ModelConfig
from inferd.models.llama import AttentionMetadata, LlamaForCausalLM, PrefillChunk


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize


class ModelRunner:
    """Turns a scheduled batch into the model's inputs and runs one forward."""

    def __init__(self, model: LlamaForCausalLM, blocks: BlockManager, dtype: torch.dtype):
        c = model.config
        self.model = model
        self.blocks = blocks
        num_slots = blocks.num_blocks * blocks.block_size
        self.kv_cache = torch.zeros(c.num_layers, 2, num_slots, c.num_kv_heads, c.head_dim, dtype=dtype)

    def run(self, batch: Batch) -> torch.Tensor:
        """Returns fp32 logits, one row per scheduled sequence that samples this step (1 + k rows for one
        verifying k drafts), in batch order."""
        input_ids, positions, slots, logits_rows = [], [], [], []
        for item in batch.seqs:
            seq, start = item.seq, item.seq.num_computed_tokens
            input_ids += seq.token_ids[start:start + item.num_tokens]
            positions += range(start, start + item.num_tokens)
            slots += (self.blocks.slot(seq, p) for p in range(start, start + item.num_tokens))
            if item.draft:  # a verification: logits after the last token and after each draft
                logits_rows += range(len(input_ids) - len(item.draft) - 1, len(input_ids))
            elif item.samples:
                logits_rows.append(len(input_ids) - 1)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            num_decode_tokens=len(batch.decodes),
            block_size=self.blocks.block_size,
            decode_blocks=None, decode_lens=None,
            prefills=self._prefill_chunks(batch))
        if batch.decodes:
            meta.decode_blocks, meta.decode_lens = self._decode_context(batch)
        return self.model(torch.tensor(input_ids), torch.tensor(positions), meta, self.kv_cache,
                          torch.tensor(logits_rows, dtype=torch.long))

    def _prefill_chunks(self, batch: Batch) -> list[PrefillChunk]:
        chunks, row = [], len(batch.decodes)
        for item in batch.prefills:
            ctx = item.seq.num_computed_tokens + item.num_tokens
            blocks = torch.tensor(item.seq.block_table[:-(-ctx // self.blocks.block_size)])
            chunks.append(PrefillChunk(row, item.num_tokens, blocks, ctx))
            row += item.num_tokens
        return chunks

    def _decode_context(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded block tables of the decodes and their context lengths."""
        bs = self.blocks.block_size
        lengths = [item.seq.num_computed_tokens + 1 for item in batch.decodes]
        width = -(-max(lengths) // bs)
        table = torch.tensor([item.seq.block_table[:width] + [0] * (width - len(item.seq.block_table[:width]))
                              for item in batch.decodes])
        return table, torch.tensor(lengths)
