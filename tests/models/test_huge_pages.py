import sys

import torch
from torch import nn

from inferd.models import huge_pages
from inferd.models.huge_pages import PAGE, mapping, move_weights


def vm_flags(address: int) -> list[str]:
    return mapping(address)["VmFlags"].split()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(300, 64)
        self.head = nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.up = nn.Linear(64, 96)
        self.register_buffer("table", torch.randn(50, 8))
        self.packed = torch.randn(96, 64)  # a plain attribute, as packed and 4-bit weights are kept
        self.packed_2d = self.packed.view(64, 96)  # the same bytes as another shape
        base = torch.randn(10, 64)
        self.part = base[2:]  # a view into a larger storage: stays

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(torch.relu(self.up(h) @ self.packed)) + self.table.sum() + self.part.sum()


def test_moved_weights_give_the_same_outputs_stay_tied_and_lie_in_one_madvised_arena():
    torch.manual_seed(0)
    net, ids = Net(), torch.tensor([1, 5, 299])
    before, part = net(ids), net.part.data_ptr()
    moved = move_weights(net, min_bytes=0)
    if not sys.platform.startswith("linux"):
        assert moved == 0
        return
    assert torch.equal(net(ids), before)
    assert net.head.weight is net.embed.weight and isinstance(net.embed.weight, nn.Parameter)
    assert net.packed_2d.data_ptr() == net.packed.data_ptr() and net.packed_2d.shape == (64, 96)
    assert net.part.data_ptr() == part
    ptrs = [t.data_ptr() for t in (net.embed.weight, net.up.weight, net.up.bias, net.table, net.packed)]
    base = min(ptrs)
    assert base % PAGE == 0 and all(p % huge_pages.ALIGN == 0 for p in ptrs)
    assert max(ptrs) < base + moved
    assert moved == sum(-(-n // 64) * 64 for n in (300 * 64 * 4, 96 * 64 * 4, 96 * 4, 50 * 8 * 4, 96 * 64 * 4))
    assert "hg" in vm_flags(base)  # MADV_HUGEPAGE: the kernel may back it with 2 MiB pages


def test_small_tensors_stay_where_they_are():
    net = Net()
    ptr = net.up.weight.data_ptr()
    assert move_weights(net) == 300 * 64 * 4  # only the 76.8 KB embedding is over 64 KiB
    assert net.up.weight.data_ptr() == ptr


def test_an_engine_on_huge_page_weights_gives_the_same_greedy_tokens(monkeypatch):
    from tests.engine.test_engine import greedy, make_engine, prompts, run
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)  # the tiny model's tensors are all small
    reqs = {f"r{i}": (p, greedy(10)) for i, p in enumerate(prompts(5, seed=43))}
    for quantization in ("none", "int4"):
        plain = make_engine(quantization=quantization, huge_page_weights=False)
        huge = make_engine(quantization=quantization)
        net = huge.runner.model
        qkv = net.layers[0].self_attn.qkv_proj
        tensor = net.embed_tokens.weight if quantization == "none" else qkv.nibbles if qkv.kernel else qkv.packed
        if sys.platform.startswith("linux"):
            assert "hg" in vm_flags(tensor.data_ptr())
        assert run(plain, reqs)[0] == run(huge, reqs)[0]
