"""The packaged GGUF written as a Hugging Face directory: inferd's own loader reads back the same model."""
import torch

from inferd.models.export import exported_dir
from inferd.models.hf import load_hf_dir
from inferd.models.loader import default_model_path, load_model


def test_an_exported_gguf_loads_back_as_the_same_weights_tokenizer_and_template(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path))
    source = load_model(default_model_path(), progress=False)
    out = exported_dir(default_model_path(), "float32")
    assert out.parent == tmp_path / "hf" and exported_dir(default_model_path(), "float32") == out  # kept once
    back = load_hf_dir(out, progress=False)
    assert back.config == source.config
    assert back.weights.keys() == source.weights.keys() - {"lm_head.weight"}
    assert all(torch.equal(back.weights[k], source.weights[k]) for k in back.weights)
    text = "Hello, world! 12345 <|im_start|>user"
    assert back.tokenizer.encode(text) == source.tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert back.tokenizer.apply_chat_template(messages, add_generation_prompt=True) == \
        source.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert back.tokenizer.eos_token_ids == source.tokenizer.eos_token_ids
    assert not list(tmp_path.glob("hf/.*"))  # nothing left aside
