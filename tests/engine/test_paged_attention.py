"""The C++ decode kernel against the torch path on the same paged cache."""
import pytest
import torch

from inferd.models.llama import Attention, AttentionMetadata
from inferd.models.paged_attention import load_kernel
from tests.tiny import tiny_config

kernel = load_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ toolchain here")


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 6), (9, 3)])
def test_kernel_matches_torch_decode(heads, kv_heads):
    config = tiny_config()
    config.num_heads, config.num_kv_heads = heads, kv_heads
    attn = Attention(config)
    g = torch.Generator().manual_seed(0)
    block_size, num_blocks, hd = 4, 40, config.head_dim
    k_cache = torch.randn(num_blocks * block_size, kv_heads, hd, generator=g)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, hd, generator=g)
    lens = torch.tensor([1, 7, 16, 13])
    width = -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[:4 * width].view(4, width)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=4,
                             block_size=block_size, decode_blocks=tables,
                             decode_lens=lens, prefills=[])
    q = torch.randn(4, heads, hd, generator=g)
    expected = attn._decode(q, meta, k_cache, v_cache)
    attn.decode_kernel = kernel
    torch.testing.assert_close(attn._decode(q, meta, k_cache, v_cache), expected, atol=1e-5, rtol=1e-5)
