"""A GGUF written as a Hugging Face directory (for vLLM): inferd's own loader reads back the same model."""
import torch

from inferd.models.export import exported_dir
from inferd.models.hf import load_hf_dir
from inferd.models.loader import load_model
from tests.models.test_gguf import Q, hf_weights, write_gguf


def test_an_exported_gguf_loads_back_as_the_same_weights_tokenizer_and_template(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf", hf_weights(), Q.Q4_1)
    source = load_model(path, progress=False)
    out = exported_dir(path, "float32")
    assert out.parent == tmp_path / "cache" / "hf" and exported_dir(path, "float32") == out  # kept once
    back = load_hf_dir(out, progress=False)
    assert back.config == source.config
    assert back.weights.keys() == source.weights.keys() - {"lm_head.weight"}
    assert all(torch.equal(back.weights[k], source.weights[k]) for k in back.weights)  # as dequantized
    text = "hi hi!<|im_start|>x"
    assert back.tokenizer.encode(text) == source.tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert back.tokenizer.apply_chat_template(messages, add_generation_prompt=True) == \
        source.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert back.tokenizer.eos_token_ids == source.tokenizer.eos_token_ids
    assert not list((tmp_path / "cache" / "hf").glob(".*"))  # nothing left aside
    bf16 = load_hf_dir(exported_dir(path), progress=False)  # the default: bf16 for vLLM's CPU backend
    assert all(torch.equal(bf16.weights[k], source.weights[k].bfloat16().float()) for k in bf16.weights)
