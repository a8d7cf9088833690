import hashlib
import json
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken, Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from inferd.models.errors import ModelLoadError
from inferd.models.loader import load_model

transformers = pytest.importorskip("transformers")

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_config(**overrides) -> "transformers.LlamaConfig":
    settings = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1,
                    rms_norm_eps=1e-6, tie_word_embeddings=False)
    return transformers.LlamaConfig(**(settings | overrides))


def save_tiny_model(path: Path, max_shard_size: str = "5GB", **overrides) -> "transformers.LlamaForCausalLM":
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config(**overrides))
    model.save_pretrained(path, max_shard_size=max_shard_size)
    save_tokenizer(path)
    return model


def save_tokenizer(path: Path) -> None:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIALS + sorted(alphabet) + ["he", "ll", "hell", "hello"])}
    hf = HFTokenizer(models.BPE(vocab, [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o")]))
    hf.pre_tokenizer, hf.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    hf.save(str(path / "tokenizer.json"))
    settings = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHATML}
    (path / "tokenizer_config.json").write_text(json.dumps(settings))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, "transformers.LlamaForCausalLM"]:
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, save_tiny_model(path)


def test_weights_equal_saved_model(tiny):
    path, model = tiny
    loaded = load_model(path, progress=False)
    expected = model.state_dict()
    assert set(loaded.weights) == set(expected) and "lm_head.weight" in loaded.weights
    assert all(torch.equal(loaded.weights[k], v.float()) for k, v in expected.items())


def test_load_progress_is_log_lines_and_no_bar_off_a_terminal(tiny, capfd, caplog):
    caplog.set_level("INFO", logger="inferd.models")
    load_model(tiny[0], progress=True)
    assert "loading tensors" not in capfd.readouterr().err
    lines = [r.getMessage() for r in caplog.records if r.name == "inferd.models.progress"]
    assert lines[0].startswith("loading tensors: ") and lines[-1].startswith("loading tensors: done"), lines


def test_config_from_config_json(tiny):
    loaded = load_model(tiny[0], progress=False)
    c = loaded.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads) == (
        300, 32, 64, 2, 4, 2)
    assert (c.head_dim, c.rms_norm_eps, c.rope_theta, c.rope_scaling, c.max_position_embeddings) == (
        8, 1e-6, 10000.0, None, 128)
    assert (c.tie_word_embeddings, c.attention_bias, c.bos_token_id) == (False, False, 0)
    assert loaded.name == tiny[0].name


def test_tokenizer_and_special_ids(tiny):
    tok = load_model(tiny[0], progress=False).tokenizer
    assert tok.add_bos and tok.encode("hello") == [0, tok.hf_tokenizer.token_to_id("hello")]
    assert tok.eos_token_ids == [1, 3]  # </s>, then <|im_end|> which the chat template ends turns with
    assert tok.decode(tok.encode("<|im_start|>hello")) == "hello"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_digests(tiny):
    path = tiny[0]
    digests = load_model(path, progress=False).digests
    assert digests["weights"] == hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    assert digests["tokenizer"] == hashlib.sha256((path / "tokenizer.json").read_bytes()).hexdigest()
    assert digests["chat_template"] == hashlib.sha256(CHATML.encode()).hexdigest()


def test_sharded_tied_model_with_generation_config(tmp_path):
    model = save_tiny_model(tmp_path, max_shard_size="40KB", tie_word_embeddings=True,
                            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    loaded = load_model(tmp_path, progress=False)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1 and "lm_head.weight" not in loaded.weights
    assert all(torch.equal(loaded.weights[k], v) for k, v in model.state_dict().items() if k != "lm_head.weight")
    assert loaded.config.tie_word_embeddings and loaded.config.eos_token_ids == [1, 2, 3]
    assert loaded.config.rope_theta == 500000.0
    assert loaded.config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_chat_template_file_wins(tiny, tmp_path):
    for file in tiny[0].iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = load_model(tmp_path, progress=False).tokenizer
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def test_unusable_directories_are_rejected(tiny, tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path, progress=False)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(tmp_path, progress=False)
    (tmp_path / "model.safetensors").write_bytes((tiny[0] / "model.safetensors").read_bytes())
    save_tokenizer(tmp_path)
    with pytest.raises(ModelLoadError, match="model_type 'gpt2'"):
        load_model(tmp_path, progress=False)
