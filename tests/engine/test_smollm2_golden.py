"""SmolLM2-135M (the packaged Q4_1 GGUF) through our loader and engine against transformers' own GGUF loading."""
import pytest
import torch

from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.engine.request import SamplingParams
from inferd.models.loader import default_model_path, load_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it to read GGUF

PROMPT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


@pytest.fixture(scope="module")
def smollm2():
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    return hf, load_model(None, progress=False)


def prompt_ids(model) -> list[int]:
    return model.tokenizer.encode(model.tokenizer.apply_chat_template(PROMPT))


def test_fp32_greedy_equals_transformers_token_for_token(smollm2):
    hf, model = smollm2
    ids = prompt_ids(model)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids):].tolist()
    assert len(ref) >= 32
    engine = LLMEngine(model, EngineConfig(dtype="float32", num_kv_blocks=64))
    engine.add_request("g", ids, SamplingParams(max_tokens=len(ref), temperature=0.0))
    engine.add_request("other", ids[:20], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    ours = []
    while engine.has_work():
        ours += [t for out in engine.step() if out.request_id == "g" for t in out.token_ids]
    assert ours == ref


def test_bf16_logits_within_tolerance_of_fp32(smollm2):
    hf, model = smollm2
    ids = prompt_ids(model)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    engine = LLMEngine(model, EngineConfig(dtype="bfloat16", num_kv_blocks=16))
    engine.add_request("b", ids, SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=5))
    (out,) = engine.step()
    ref_lp = ref.log_softmax(-1)
    top_ids = [t for t, _ in out.logprobs[0].top]
    assert top_ids[0] in ref_lp.topk(2).indices.tolist()
    for token, lp in out.logprobs[0].top:
        assert lp == pytest.approx(ref_lp[token].item(), abs=0.35)


def test_fp32_prompt_logprobs_equal_transformers_across_chunks_and_a_cached_prefix(smollm2):
    """Every prompt token's logprob (what /v1/completions' echo returns), prompt longer than a chunk, computed
    once with nothing cached and once after another request left the prompt's blocks in the prefix cache."""
    hf, model = smollm2
    text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg built a "
            "machine that pressed inked metal type onto paper. Books became cheaper, literacy spread across Europe, "
            "and ideas moved faster than ever before. Scholars argue about how much of the Reformation, the "
            "scientific revolution and the rise of newspapers followed from it.")
    ids = model.tokenizer.encode(text)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    ref_lp = ref.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    engine = LLMEngine(model, EngineConfig(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32))
    assert len(ids) > 2 * 32
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=1, prompt_logprobs=True)
    engine.add_request("warm", ids, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_work():
        engine.step()
    for rid in ("after-cache", "again"):
        engine.add_request(rid, ids, params)
        outs = []
        while engine.has_work():
            outs += engine.step()
        got = outs[0].prompt_logprobs
        assert outs[-1].num_cached_tokens == 0 and [lp.token_id for lp in got] == ids[1:]
        diff = (torch.tensor([lp.logprob for lp in got]) - ref_lp).abs().max().item()
        assert diff < 1e-4, f"largest difference from transformers: {diff:.2e}"
        assert [lp.top[0][0] for lp in got] == ref.argmax(-1).tolist()
