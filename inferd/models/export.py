"""A model source (a GGUF file or a model directory) written as a Hugging Face directory, for runtimes that
read only that (vLLM's CPU backend cannot run a GGUF file's quantized blocks).

The directory holds exactly what inferd loads: the weights after dequantization (rounded to `dtype`), the
tokenizer rebuilt from the GGUF metadata, its chat template and stop tokens. An export is kept once per source
digest and dtype under $INFERD_CACHE_DIR (default ~/.cache/inferd)/hf, written aside and then renamed, so a
directory that exists is complete.
"""
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from inferd.models.config import LoadedModel
from inferd.models.loader import load_model

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
VERSION = 1  # bump when what an export holds changes


def exported_dir(source: Path, dtype: str = "bfloat16") -> Path:
    """The Hugging Face directory of source (a directory is its own); exported on first use."""
    if source.is_dir():
        return source
    model = load_model(source, progress=False)
    root = Path(os.environ.get("INFERD_CACHE_DIR") or Path.home() / ".cache" / "inferd") / "hf"
    path = root / f"{model.digests['weights'][:16]}-{model.digests['tokenizer'][:8]}-{dtype}-v{VERSION}"
    if not path.is_dir():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            write_hf_dir(model, tmp, dtype)
            tmp.rename(path)  # fails if another process got there first: theirs is as good
        except OSError:
            if not path.is_dir():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def write_hf_dir(model: LoadedModel, out: Path, dtype: str = "bfloat16") -> None:
    c, t = model.config, model.tokenizer
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM" if not c.attention_bias else "Qwen2ForCausalLM"],
              "model_type": "llama" if not c.attention_bias else "qwen2", "vocab_size": c.vocab_size,
              "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
              "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
              "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
              "tie_word_embeddings": c.tie_word_embeddings, "hidden_act": "silu", "torch_dtype": dtype,
              "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_ids[0] if c.eos_token_ids else None}
    if c.rope_scaling:
        config["rope_scaling"] = c.rope_scaling
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": c.bos_token_id,
                                                            "eos_token_id": c.eos_token_ids}))
    weights = {name: w.to(DTYPES[dtype]).contiguous() for name, w in model.weights.items()
               if not (c.tie_word_embeddings and name == "lm_head.weight")}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    t.hf_tokenizer.save(str(out / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": t.bos_token, "eos_token": t.eos_token,
                "add_bos_token": t.add_bos, "chat_template": t.chat_template,
                "model_max_length": c.max_position_embeddings}
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))
