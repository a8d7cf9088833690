"""Our BERT and the sentence-transformers loader against sentence-transformers itself: the packaged
all-MiniLM-L6-v2 (mean pooling, Normalize) and tiny random models saved here (cls and max pooling)."""
import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers, processors

from inferd.models.bert import BertEncoder, load_weights, pool
from inferd.models.errors import ModelLoadError
from inferd.models.sentence import default_embedding_model_path, load_embedding_model
from tests.minilm import TEXTS, minilm_files, sentence_transformer

transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def encoder_of(files, dtype: torch.dtype = torch.float32) -> BertEncoder:
    encoder = BertEncoder(files.config)
    load_weights(encoder, files.weights)
    return encoder.eval().to(dtype)


def embed(files, texts: list[str], encoder: BertEncoder | None = None) -> torch.Tensor:
    """Our encoder over one padded batch of texts, pooled (and normalised) as the files say."""
    encoder = encoder or encoder_of(files)
    rows = [e.ids for e in files.tokenizer.encode_batch(texts)]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), True
    with torch.inference_mode():
        pooled = pool(encoder(ids, mask), mask, files.pooling)
    return F.normalize(pooled, dim=-1) if files.normalize else pooled


def cosines(ours: torch.Tensor, theirs) -> list[float]:
    return F.cosine_similarity(ours.float(), torch.as_tensor(theirs).float(), dim=-1).tolist()


# the packaged model

def test_the_packaged_model_loads_as_its_directory_describes_it():
    files = minilm_files()
    assert default_embedding_model_path().name == "model.zip" and files.name == "all-MiniLM-L6-v2"
    assert (files.pooling, files.normalize, files.dimensions, files.max_input_tokens) == ("mean", True, 384, 256)
    weights = hashlib.sha256((files.directory / "model.safetensors").read_bytes()).hexdigest()
    assert files.digests["weights"] == weights and len(files.digests["tokenizer"]) == 64
    assert files.tokenizer.truncation is None and files.tokenizer.padding is None


@pytest.mark.parametrize("dtype, least", [(torch.float32, 0.9999), (torch.bfloat16, 0.999)])
def test_embeddings_equal_sentence_transformers_alone_and_among_padding(dtype, least):
    files, reference = minilm_files(), sentence_transformer().encode(TEXTS, convert_to_tensor=True)
    encoder = encoder_of(files, dtype)
    assert min(cosines(embed(files, TEXTS, encoder), reference)) >= least  # one batch: short ones padded
    alone = torch.cat([embed(files, [t], encoder) for t in TEXTS])
    assert min(cosines(alone, reference)) >= least


# tiny random models: other pooling modes, zips, what is refused

def save_tiny_model(path: Path, pooling: str, normalize: bool = False) -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(path)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {t: i for i, t in enumerate(SPECIALS + letters + ["##" + c for c in "aeiou"] + ["the", "cat", "sat"])}
    tok = HFTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32,
                                                                f"pooling_mode_{pooling}": True}))


@pytest.mark.parametrize("pooling, mode", [("cls_token", "cls"), ("max_tokens", "max"), ("mean_tokens", "mean")])
def test_pooling_modes_equal_sentence_transformers(tmp_path, pooling, mode):
    save_tiny_model(tmp_path, pooling)
    files = load_embedding_model(tmp_path)
    texts = ["the cat sat", "a cat", "the the the cat sat on a mat uo", "z"]
    assert files.pooling == mode and not files.normalize and files.max_input_tokens == 64
    reference = st.SentenceTransformer(str(tmp_path), device="cpu").encode(texts, convert_to_tensor=True)
    assert min(cosines(embed(files, texts), reference)) >= 0.9999
    assert torch.allclose(embed(files, texts), reference, atol=1e-4)


def test_a_zip_is_unpacked_once_into_the_cache_keyed_by_its_digest(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path / "cache"))
    save_tiny_model(tmp_path / "tiny", "mean_tokens", normalize=True)
    archive = tmp_path / "tiny.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for f in (tmp_path / "tiny").rglob("*"):
            z.write(f, Path("tiny") / f.relative_to(tmp_path / "tiny"))  # one top folder, as many zips have
    files = load_embedding_model(archive)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    assert files.directory == tmp_path / "cache" / "unpacked" / digest / "tiny" and files.name == "tiny"
    assert files.normalize and files.source == archive
    monkeypatch.setattr(zipfile.ZipFile, "extractall", lambda *a, **k: pytest.fail("unpacked twice"))
    again = load_embedding_model(archive)
    assert again.directory == files.directory and again.digests == files.digests
    assert torch.equal(embed(again, ["the cat"]), embed(load_embedding_model(tmp_path / "tiny"), ["the cat"]))


def test_what_cannot_be_loaded_says_why(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_embedding_model(tmp_path)
    save_tiny_model(tmp_path / "dense", "mean_tokens")
    modules = json.loads((tmp_path / "dense" / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "dense" / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match="Dense"):
        load_embedding_model(tmp_path / "dense")
    with pytest.raises(ModelLoadError, match="neither a directory nor a .zip"):
        load_embedding_model(tmp_path / "missing.zip")
    (tmp_path / "bad.zip").write_bytes(b"not a zip")
    with pytest.raises(ModelLoadError, match="not a readable zip"):
        load_embedding_model(tmp_path / "bad.zip")
