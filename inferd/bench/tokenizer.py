import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from inferd.bench.errors import WorkloadError
from inferd.models.errors import ModelLoadError
from inferd.models.tokenizer import Tokenizer

ApiKind = Literal["chat", "completions"]
WORD = re.compile(r"^ [a-z]{3,12}$")


# loading only the tokenizer of a model source

def load_tokenizer(source: str | Path) -> Tokenizer:
    """The tokenizer of a .gguf file or a Hugging Face directory, without reading weights."""
    path = Path(source).expanduser()
    try:
        if path.is_dir():
            from inferd.models.hf import read_json, read_tokenizer
            return read_tokenizer(path, read_json(path / "config.json") or {})
        if path.is_file() and path.suffix.lower() == ".gguf":
            from inferd.models.gguf import PlainArrayReader, read_tokenizer as read_gguf_tokenizer
            return read_gguf_tokenizer(PlainArrayReader(path))
    except (ModelLoadError, ValueError) as exc:
        raise WorkloadError(f"cannot read the tokenizer of {path}: {exc}") from exc
    raise WorkloadError(f"tokenizer source {path} is neither a .gguf file nor a Hugging Face directory; "
                        "pass --tokenizer with the served model's file or directory")


def served_tokenizer(flag: str | None, source_path: str | None, digest: str | None) -> Tokenizer:
    """The served model's tokenizer: --tokenizer; else the card's source_path (a replica's /v1/models, on this
    machine); else the packaged default model's, if its digest is the card's (a gateway shows tenants no paths)."""
    source = flag or source_path
    if source is not None and Path(source).expanduser().exists():
        return load_tokenizer(source)
    packaged = None if flag else _packaged_tokenizer(digest)
    if packaged is None:
        raise WorkloadError(f"the served model's tokenizer is not readable here ({source!r}); "
                            "pass --tokenizer with the model's .gguf file or Hugging Face directory")
    return packaged


def _packaged_tokenizer(digest: str | None) -> Tokenizer | None:
    from inferd.models.gguf import sha256_text
    from inferd.models.loader import default_model_path
    try:
        tokenizer = load_tokenizer(default_model_path())
    except ModelLoadError:  # not installed
        return None
    return tokenizer if digest == sha256_text(tokenizer.hf_tokenizer.to_str()) else None  # as gguf.digests has it


# prompt lengths as the server counts them

@dataclass(slots=True)
class PromptCounter:
    """Counts a prompt's tokens the way inferd's API does: chat template applied for chat."""
    tokenizer: Tokenizer
    api: ApiKind
    templated: bool = field(init=False)

    def __post_init__(self):
        self.templated = self.api == "chat" and self.tokenizer.chat_template is not None

    def count(self, text: str) -> int:
        if not self.templated:
            return len(self.tokenizer.encode(text, add_special_tokens=self.api == "completions"))
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return len(self.tokenizer.encode(rendered, add_special_tokens=False))


def word_pool(tokenizer: Tokenizer) -> list[str]:
    """Single-token lowercase words with a leading space: text built from them has a predictable length."""
    hf = tokenizer.hf_tokenizer
    pool = []
    for token_id in range(hf.get_vocab_size(with_added_tokens=False)):
        text = hf.decode([token_id])
        if WORD.match(text) and hf.encode(text, add_special_tokens=False).ids == [token_id]:
            pool.append(text)
    if len(pool) < 100:
        raise WorkloadError(f"the tokenizer has only {len(pool)} plain single-token words; "
                            "synthetic prompts need a byte-level BPE or SentencePiece vocabulary")
    return pool
