"""A local cache of what loading a GGUF file produces: its float32 weights, tokenizer and config.

Reading a GGUF means parsing its metadata (the vocabulary, merges) and dequantizing every tensor: most of
a replica's cold start. The result depends only on the file's bytes and this code, so it is kept once per
file digest under $INFERD_CACHE_DIR (default ~/.cache/inferd) as safetensors + JSON, and later loads of
the same file read that instead. A cache entry appears atomically (written aside, then renamed); one that
cannot be read is removed and written again. INFERD_WEIGHT_CACHE=0 turns it off.
"""
import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer

from inferd.models.config import ModelConfig
from inferd.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

VERSION = 1  # bump when what load_gguf produces changes (names, layouts, tokenizer rebuilding)


def cache_root() -> Path | None:
    if os.environ.get("INFERD_WEIGHT_CACHE", "1") == "0":
        return None
    return Path(os.environ.get("INFERD_CACHE_DIR") or Path.home() / ".cache" / "inferd") / "gguf"


def entry(digest: str) -> Path | None:
    root = cache_root()
    return None if root is None else root / f"{digest}-v{VERSION}"


def read(digest: str) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer] | None:
    path = entry(digest)
    if path is None or not path.is_dir():
        return None
    try:
        meta = json.loads((path / "meta.json").read_text())
        tokenizer = Tokenizer(HFTokenizer.from_file(str(path / "tokenizer.json")), meta["chat_template"],
                              meta["bos_token_id"], meta["eos_token_ids"], meta["add_bos"])
        return ModelConfig(**meta["config"]), load_file(path / "weights.safetensors"), tokenizer
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as exc:  # damaged: load the file
        log.warning("replacing the unreadable weight cache %s (%s)", path, exc)
        shutil.rmtree(path, ignore_errors=True)
        return None


def write(digest: str, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer) -> None:
    path = entry(digest)
    if path is None or path.is_dir():
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, tmp / "weights.safetensors")
        tokenizer.hf_tokenizer.save(str(tmp / "tokenizer.json"))
        meta = {"config": asdict(config), "chat_template": tokenizer.chat_template,
                "bos_token_id": tokenizer.bos_token_id, "eos_token_ids": tokenizer.eos_token_ids,
                "add_bos": tokenizer.add_bos}
        (tmp / "meta.json").write_text(json.dumps(meta))
        tmp.rename(path)  # fails if another process got there first: theirs is as good
    except OSError as exc:
        if not path.is_dir():
            log.warning("could not write the weight cache %s (%s)", path, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
