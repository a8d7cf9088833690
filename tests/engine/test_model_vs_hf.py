"""Our paged-KV Llama forward against Hugging Face transformers on the same random weights."""
import pytest
import torch

from inferd.engine.block_manager import BlockManager
from inferd.engine.config import EngineConfig
from inferd.engine.model_runner import ModelRunner
from inferd.engine.request import SamplingParams
from inferd.engine.scheduler import Scheduler
from inferd.engine.sequence import Sequence
from inferd.models.llama import LlamaForCausalLM
from tests.tiny import tiny_hf_model

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("variant", ["llama", "qwen2", "llama3_rope"])
def test_prefill_and_decode_logits_match_transformers(variant):
    hf, config = tiny_hf_model(variant)
    ours = LlamaForCausalLM(config, max_positions=256)
    ours.load_weights(hf.state_dict())
    blocks = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(EngineConfig(max_num_seqs=8, max_num_batched_tokens=256), blocks)
    runner = ModelRunner(ours, blocks, torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (5, 11, 3)]
    seqs = [Sequence(f"r{i}", p, SamplingParams(max_tokens=32)) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    for step in range(17):  # one prefill, 16 decodes, all three sequences in each batch
        batch = sched.schedule()
        assert len(batch.seqs) == 3 and (step == 0) == bool(batch.prefills)
        logits = runner.run(batch)
        for item in batch.seqs:
            item.seq.num_computed_tokens += item.num_tokens
        for seq, row in zip([item.seq for item in batch.seqs], logits):
            with torch.no_grad():
                ref = hf(torch.tensor([seq.token_ids])).logits[0, -1]
            torch.testing.assert_close(row, ref, atol=2e-4, rtol=1e-4)
            seq.token_ids.append(int(row.argmax()))
    for s in seqs:
        sched.finish(s, "length")
    assert blocks.num_free_blocks == blocks.num_blocks


def test_chunked_prefill_matches_one_shot():
    hf, config = tiny_hf_model("llama")
    ours = LlamaForCausalLM(config, max_positions=256)
    ours.load_weights(hf.state_dict())
    blocks = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=7), blocks)
    runner = ModelRunner(ours, blocks, torch.float32)
    prompt = torch.randint(0, config.vocab_size, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = Sequence("r", prompt, SamplingParams(max_tokens=4))
    sched.add(seq)
    steps = 0
    while seq.num_computed_tokens < len(prompt):
        batch = sched.schedule()
        logits = runner.run(batch)
        assert batch.num_tokens <= 7
        for item in batch.seqs:
            item.seq.num_computed_tokens += item.num_tokens
        steps += 1
    assert steps == 5 and logits.shape[0] == 1
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], ref, atol=2e-4, rtol=1e-4)
