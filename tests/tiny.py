"""Tiny random-weight models built inside the tests."""
import torch

from inferd.models.config import ModelConfig

VOCAB = 384


def tiny_config(variant: str = "llama") -> ModelConfig:
    rope_scaling = None
    if variant == "llama3_rope":
        rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 16}
    return ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                       rope_scaling=rope_scaling, max_position_embeddings=512,
                       tie_word_embeddings=variant != "qwen2", attention_bias=variant == "qwen2",
                       bos_token_id=1, eos_token_ids=[2])


def tiny_hf_model(variant: str = "llama", seed: int = 0):
    """A transformers model with random weights and our ModelConfig of the same architecture."""
    import transformers

    c = tiny_config(variant)
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                  num_key_value_heads=c.num_kv_heads, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                  max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings)
    torch.manual_seed(seed)
    if variant == "qwen2":
        hf_config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(hf_config)
    else:
        hf_config = transformers.LlamaConfig(**common, head_dim=c.head_dim, rope_scaling=c.rope_scaling)
        model = transformers.LlamaForCausalLM(hf_config)
    with torch.no_grad():
        for p in model.parameters():  # random norms and biases too, so their loading is checked
            p.add_(torch.randn_like(p) * 0.05)
    return model.float().eval(), c


def tiny_tokenizer():
    """A byte-level BPE tokenizer over printable ASCII whose ids cover the tiny model's whole vocabulary,
    so that whatever a random model samples decodes to text."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    from inferd.models.tokenizer import Tokenizer

    specials = ["<unk>", "<s>", "</s>"]
    chars = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]  # byte-level forms of " " and "\n"
    vocab = {t: i for i, t in enumerate(specials + chars)}
    merges = []
    for a in "etaoinsr":
        for b in "etaoinsr":
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    for i in range(len(vocab), VOCAB):
        vocab[f"\u0120w{i}"] = i
    hf = HFTokenizer(models.BPE(vocab, merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(specials)
    template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant: {% endif %}")
    return Tokenizer(hf, template, bos_token_id=1, eos_token_ids=[2])


def tiny_loaded_model(variant: str = "llama"):
    from pathlib import Path

    from inferd.models.config import LoadedModel

    hf, config = tiny_hf_model(variant)
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return LoadedModel(name=f"tiny-{variant}", path=Path("/nonexistent"), config=config, weights=weights,
                       tokenizer=tiny_tokenizer(), digests={"weights": "", "tokenizer": "", "chat_template": ""})
