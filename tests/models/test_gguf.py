import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from inferd.models.errors import ModelLoadError
from inferd.models.gguf import hf_name, model_name, unpermute
from inferd.models.loader import default_model_path, load_model

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, INTER = 64, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
BYTE_TOKENS = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "Ċ"]
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
MERGES = ["h i", "Ġ h", "Ġh i"]
TOKENS = SPECIAL_TOKENS + BYTE_TOKENS + ["hi", "Ġh", "Ġhi"]
# Worst-case error of each type relative to the largest magnitude in the tensor.
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.1}


# ---- writing tiny GGUF files

def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k weights of Llama models."""
    halves = weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def hf_weights(seed: int = 0, vocab: int = len(TOKENS)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"token_embd": (vocab, HIDDEN), "output_norm": (HIDDEN,), "blk.0.attn_norm": (HIDDEN,),
              "blk.0.ffn_norm": (HIDDEN,), "blk.0.attn_q": (HIDDEN, HIDDEN),
              "blk.0.attn_k": (KV_HEADS * HEAD_DIM, HIDDEN), "blk.0.attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
              "blk.0.attn_output": (HIDDEN, HIDDEN),
              "blk.0.ffn_gate": (INTER, HIDDEN), "blk.0.ffn_up": (INTER, HIDDEN), "blk.0.ffn_down": (HIDDEN, INTER)}
    return {f"{name}.weight": rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_gguf(path: Path, tensors: dict[str, np.ndarray], qtype=Q.F32, arch: str = "llama",
               tokenizer: dict | None = None, metadata=lambda w: None) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1), writer.add_context_length(256), writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER), writer.add_head_count(HEADS), writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0), writer.add_layer_norm_rms_eps(1e-6)
    write_tokenizer(writer, tokenizer or byte_level_vocab())
    metadata(writer)
    for name, value in tensors.items():
        add_tensor(writer, name, value, qtype if value.ndim == 2 else Q.F32)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return path


def add_tensor(writer: gguf.GGUFWriter, name: str, value: np.ndarray, qtype) -> None:
    data = gguf.quants.quantize(value, qtype) if value.dtype == np.float32 else value
    writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)


def byte_level_vocab() -> dict:
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(TOKENS) - len(SPECIAL_TOKENS))
    return {"model": "gpt2", "pre": "default", "tokens": TOKENS, "types": types, "merges": MERGES,
            "bos": 0, "eos": 1,
            "template": "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"}


def write_tokenizer(writer: gguf.GGUFWriter, vocab: dict) -> None:
    writer.add_tokenizer_model(vocab["model"]), writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_bos_token_id(vocab["bos"]), writer.add_eos_token_id(vocab["eos"])
    if "pre" in vocab:
        writer.add_tokenizer_pre(vocab["pre"])
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])
    if "scores" in vocab:
        writer.add_token_scores(vocab["scores"]), writer.add_unk_token_id(vocab["unk"])
    if "template" in vocab:
        writer.add_chat_template(vocab["template"])


# ---- tensors

@pytest.mark.parametrize("qtype", list(TOLERANCE))
def test_dequantized_weights_match_originals(tmp_path, qtype):
    original = hf_weights()
    model = load_model(write_gguf(tmp_path / "tiny.gguf", original, qtype, arch="qwen2"), progress=False)
    for name, value in original.items():
        loaded = model.weights[hf_name(name)]
        stored = qtype if value.ndim == 2 else Q.F32
        exact = gguf.quants.dequantize(gguf.quants.quantize(value, stored), stored)
        assert loaded.dtype == torch.float32 and tuple(loaded.shape) == value.shape, name
        np.testing.assert_array_equal(loaded.numpy(), exact.reshape(value.shape).astype(np.float32))
        assert np.abs(loaded.numpy() - value).max() <= TOLERANCE[stored] * np.abs(value).max(), name


def test_llama_qk_permutation_is_undone(tmp_path):
    original = hf_weights()
    permuted = dict(original)
    permuted["blk.0.attn_q.weight"] = llama_cpp_permute(original["blk.0.attn_q.weight"], HEADS)
    permuted["blk.0.attn_k.weight"] = llama_cpp_permute(original["blk.0.attn_k.weight"], KV_HEADS)
    model = load_model(write_gguf(tmp_path / "tiny.gguf", permuted), progress=False)
    for proj in "qkv":
        expected = original[f"blk.0.attn_{proj}.weight"]
        np.testing.assert_array_equal(model.weights[f"model.layers.0.self_attn.{proj}_proj.weight"].numpy(), expected)


def test_unpermute_inverts_permute_for_bias_vectors():
    bias = np.arange(HIDDEN, dtype=np.float32)
    back = unpermute(torch.from_numpy(llama_cpp_permute(bias, HEADS)), HEADS)
    np.testing.assert_array_equal(back.numpy(), bias)


def test_qwen2_biases_are_kept_and_not_permuted(tmp_path):
    tensors = hf_weights() | {f"blk.0.attn_{p}.bias": np.arange(n, dtype=np.float32)
                              for p, n in (("q", HIDDEN), ("k", KV_HEADS * HEAD_DIM), ("v", KV_HEADS * HEAD_DIM))}
    model = load_model(write_gguf(tmp_path / "tiny.gguf", tensors, arch="qwen2"), progress=False)
    assert model.config.attention_bias
    np.testing.assert_array_equal(model.weights["model.layers.0.self_attn.q_proj.bias"].numpy(), np.arange(HIDDEN))
    np.testing.assert_array_equal(model.weights["model.layers.0.self_attn.q_proj.weight"].numpy(),
                                  tensors["blk.0.attn_q.weight"])


# ---- config

def test_config_from_metadata(tmp_path):
    model = load_model(write_gguf(tmp_path / "Tiny-Model.Q8_0.gguf", hf_weights()), progress=False)
    c = model.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        1, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM)
    assert (c.vocab_size, c.rms_norm_eps, c.rope_theta, c.max_position_embeddings) == (
        len(TOKENS), 1e-6, 10000.0, 256)
    assert c.tie_word_embeddings and "lm_head.weight" not in model.weights and not c.attention_bias
    assert (c.bos_token_id, c.eos_token_ids, c.rope_scaling) == (0, [1], None)
    assert model.name == "Tiny-Model" and set(model.digests) == {"weights", "tokenizer", "chat_template"}


def test_untied_output_becomes_lm_head(tmp_path):
    tensors = hf_weights() | {"output.weight": np.ones((len(TOKENS), HIDDEN), np.float32)}
    model = load_model(write_gguf(tmp_path / "tiny.gguf", tensors), progress=False)
    assert not model.config.tie_word_embeddings
    assert torch.equal(model.weights["lm_head.weight"], torch.ones(len(TOKENS), HIDDEN))


def test_linear_rope_scaling(tmp_path):
    def metadata(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), w.add_rope_scaling_factor(4.0)
    model = load_model(write_gguf(tmp_path / "tiny.gguf", hf_weights(), metadata=metadata), progress=False)
    assert model.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def llama3_rope_freqs(factor: float, theta: float = 10000.0) -> np.ndarray:
    """As llama.cpp's converter writes rope_freqs for Llama 3.1 (low 1, high 4, original context 8192)."""
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM):
        wavelength = 2 * np.pi / freq
        smooth = (8192 / wavelength - 1) / (4 - 1)
        blended = 1 / ((1 - smooth) / factor + smooth)
        factors.append(1 if wavelength < 8192 / 4 else factor if wavelength > 8192 else blended)
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path):
    tensors = hf_weights() | {"rope_freqs.weight": llama3_rope_freqs(8.0)}
    model = load_model(write_gguf(tmp_path / "tiny.gguf", tensors), progress=False)
    assert model.config.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in model.weights


def test_unknown_rope_freqs_are_rejected(tmp_path):
    tensors = hf_weights() | {"rope_freqs.weight": np.linspace(1, 3, HEAD_DIM // 2, dtype=np.float32)}
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        load_model(write_gguf(tmp_path / "tiny.gguf", tensors), progress=False)


# ---- rejections

def test_unsupported_architecture_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="'gpt2' model"):
        load_model(write_gguf(tmp_path / "tiny.gguf", hf_weights(), arch="gpt2"), progress=False)


def test_unknown_tensor_is_rejected(tmp_path):
    tensors = hf_weights() | {"blk.0.ffn_gate_exps.weight": np.ones((4, 4), np.float32)}
    with pytest.raises(ModelLoadError, match="ffn_gate_exps"):
        load_model(write_gguf(tmp_path / "tiny.gguf", tensors), progress=False)


def test_tensor_type_without_dequantization_is_rejected(tmp_path):
    tensors = hf_weights() | {"blk.0.attn_q.bias": np.arange(HIDDEN, dtype=np.int32)}
    with pytest.raises(ModelLoadError, match="I32"):
        load_model(write_gguf(tmp_path / "tiny.gguf", tensors), progress=False)


def test_missing_and_non_model_sources_are_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "absent.gguf")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="neither"):
        load_model(tmp_path / "notes.txt")


def test_vocab_and_embedding_disagreement_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="token_embd has 7 rows"):
        load_model(write_gguf(tmp_path / "tiny.gguf", hf_weights(vocab=7)), progress=False)


def test_model_name_drops_quant_tag():
    assert [model_name(Path(p)) for p in ("a/SmolLM2-135M-Instruct.Q4_1.gguf", "b/Llama-3.2-1B-Q4_K_M.gguf",
                                          "c/qwen2-0.5b.gguf", "d/x.BF16.gguf")] == [
        "SmolLM2-135M-Instruct", "Llama-3.2-1B", "qwen2-0.5b", "x"]


# ---- the shipped SmolLM2 GGUF

@pytest.fixture(scope="module")
def smollm2():
    return load_model(None, progress=False)


def test_default_model_path_finds_smollm2():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_smollm2_config(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size) == (
        30, 9, 3, 64, 576, 1536)
    assert (c.vocab_size, c.rope_theta, c.tie_word_embeddings, c.rms_norm_eps) == (49152, 100000.0, True, 1e-5)
    assert (c.max_position_embeddings, c.bos_token_id, c.eos_token_ids) == (8192, 1, [2])
    assert smollm2.name == "SmolLM2-135M-Instruct"


def test_smollm2_digests(smollm2):
    with smollm2.path.open("rb") as f:
        assert smollm2.digests["weights"] == hashlib.file_digest(f, "sha256").hexdigest()
    serialized = smollm2.tokenizer.hf_tokenizer.to_str().encode()
    assert smollm2.digests["tokenizer"] == hashlib.sha256(serialized).hexdigest()
    assert smollm2.digests["chat_template"] == hashlib.sha256(smollm2.tokenizer.chat_template.encode()).hexdigest()


def test_smollm2_weights(smollm2):
    w = smollm2.weights
    assert len(w) == 2 + 30 * 9 and "lm_head.weight" not in w
    assert w["model.embed_tokens.weight"].shape == (49152, 576)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert w["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in w.values())


# ---- the load cache

def test_a_second_load_comes_from_the_cache_and_equals_the_first(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf", hf_weights(), Q.Q8_0)
    first = load_model(path, progress=False)
    entries = list((tmp_path / "cache" / "gguf").iterdir())
    assert [e.name for e in entries] == [f"{first.digests['weights']}-v1"]
    monkeypatch.setattr("inferd.models.gguf.read_gguf", lambda *a: pytest.fail("parsed the GGUF again"))
    second = load_model(path, progress=False)
    assert second.config == first.config and second.digests == first.digests
    assert second.weights.keys() == first.weights.keys()
    assert all(torch.equal(second.weights[k], first.weights[k]) for k in first.weights)
    t1, t2 = first.tokenizer, second.tokenizer
    assert (t2.chat_template, t2.bos_token_id, t2.eos_token_ids, t2.add_bos) == \
        (t1.chat_template, t1.bos_token_id, t1.eos_token_ids, t1.add_bos)
    assert t2.encode("hi hi!") == t1.encode("hi hi!")


def test_a_damaged_cache_entry_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf", hf_weights(), Q.F32)
    first = load_model(path, progress=False)
    (tmp_path / "cache" / "gguf" / f"{first.digests['weights']}-v1" / "weights.safetensors").write_bytes(b"junk")
    again = load_model(path, progress=False)  # from the file, and the entry is written again
    assert all(torch.equal(again.weights[k], first.weights[k]) for k in first.weights)
    monkeypatch.setattr("inferd.models.gguf.read_gguf", lambda *a: pytest.fail("parsed the GGUF again"))
    assert load_model(path, progress=False).digests == first.digests


def test_the_cache_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("INFERD_WEIGHT_CACHE", "0")
    load_model(write_gguf(tmp_path / "tiny.gguf", hf_weights(), Q.F32), progress=False)
    assert not (tmp_path / "cache").exists()


def test_load_progress_is_log_lines_and_no_bar_off_a_terminal(tmp_path, monkeypatch, capfd, caplog):
    monkeypatch.setenv("INFERD_WEIGHT_CACHE", "0")  # parsed, as on a first start
    caplog.set_level("INFO", logger="inferd.models")
    load_model(write_gguf(tmp_path / "tiny.gguf", hf_weights()), progress=True)
    assert "loading tensors" not in capfd.readouterr().err  # no tqdm bar between JSON log lines
    lines = [r for r in caplog.records if r.name == "inferd.models.progress"]
    assert [r.percent for r in lines] == list(range(0, 101, 10)), [r.getMessage() for r in lines]
    assert lines[-1].getMessage().startswith("loading tensors: done") and lines[-1].duration_s >= 0
