import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from inferd.models.errors import ChatTemplateError, ModelLoadError
from inferd.models.gguf import PlainArrayReader, read_tokenizer
from inferd.models.loader import default_model_path, load_model
from inferd.models.tokenizer import Tokenizer
from tests.models.test_gguf import byte_level_vocab, hf_weights, write_gguf

TEXTS = ["Hello, world! How are you today?", "12345", "I have 5 apples, year 2024",
         "def square(x):\n    return x ** 2  # power\n", "naïve café 🤗🚀 日本語 ñ",
         "  two spaces\n\n\ttab", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return read_tokenizer(PlainArrayReader(default_model_path()))


@pytest.fixture(scope="module")
def transformers_smollm2():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# ---- SmolLM2 (byte-level BPE from GGUF metadata)

@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_encode_matches_transformers(smollm2, transformers_smollm2, text):
    assert smollm2.encode(text) == transformers_smollm2.encode(text)


def test_smollm2_pre_tokenizer_splits_digits_as_metadata_prescribes(smollm2):
    # transformers' GGUF converter does not know pre "smollm" and keeps plain ByteLevel; SmolLM2's
    # vocabulary has no multi-digit tokens, so both give the same ids, but the split itself differs.
    pieces = [p for p, _ in smollm2.hf_tokenizer.pre_tokenizer.pre_tokenize_str("x 123")]
    assert pieces == ["x", "Ġ", "1", "2", "3"]


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_round_trip(smollm2, text):
    assert smollm2.decode(smollm2.encode(text), skip_special_tokens=False) == text


def test_smollm2_special_tokens(smollm2):
    assert smollm2.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert smollm2.decode([1, 4093, 2]) == "user"
    assert (smollm2.bos_token_id, smollm2.eos_token_ids, smollm2.add_bos) == (1, [2], False)
    assert smollm2.vocab_size == 49152


def test_smollm2_chat_template_is_chatml_with_default_system(smollm2):
    prompt = smollm2.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                      "trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    own = smollm2.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                      add_generation_prompt=False)
    assert own == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_stream_decode_equals_full_decode(smollm2):
    text = "Emoji 🤗🚀 and 日本語, café."
    ids = smollm2.encode(text)
    stream = smollm2.new_decode_stream()
    pieces = [stream.step(i) for i in ids]
    assert None in pieces  # the emoji span several byte tokens
    assert "".join(p for p in pieces if p is not None) == smollm2.decode(ids) == text


def test_stream_decode_skips_special_tokens(smollm2):
    stream = smollm2.new_decode_stream()
    assert "".join(p or "" for p in map(stream.step, smollm2.encode("<|im_start|>hi<|im_end|>"))) == "hi"


# ---- Tokenizer behaviour

def tiny_tokenizer(template: str | None = None, add_bos: bool = True) -> Tokenizer:
    hf = HFTokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "a": 2, "b": 3}, unk_token="<s>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(hf, template, bos_token_id=0, eos_token_ids=[1], add_bos=add_bos)


def test_bos_is_added_once_and_only_when_asked():
    tok = tiny_tokenizer()
    assert tok.encode("a b") == [0, 2, 3]
    assert tok.encode("<s> a") == [0, 2]
    assert tok.encode("a", add_special_tokens=False) == [2]
    assert tiny_tokenizer(add_bos=False).encode("a") == [2]


def test_template_sees_bos_eos_and_tojson():
    tok = tiny_tokenizer("{{ bos_token }}{{ messages | tojson }}{{ tools | tojson(indent=1) }}{{ eos_token }}")
    out = tok.apply_chat_template([{"role": "user", "content": "<é>"}], tools=[{"name": "f"}])
    assert out == '<s>[{"role": "user", "content": "<é>"}][\n {\n  "name": "f"\n }\n]</s>'


def test_template_errors_are_typed():
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tiny_tokenizer().apply_chat_template([{"role": "user", "content": "a"}])
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tiny_tokenizer("{{ raise_exception('roles must alternate') }}").apply_chat_template([])
    with pytest.raises(ModelLoadError, match="does not compile"):
        tiny_tokenizer("{% for %}")


# ---- other GGUF tokenizers

def sentencepiece_vocab() -> dict:
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "ll", "he", "▁h", "▁w", "llo", "or", "▁he", "▁wor",
              "▁hello", "▁world", "<think>"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 1) + [4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores, "unk": 0, "bos": 1, "eos": 2}


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    vocab = sentencepiece_vocab()
    path = write_gguf(tmp_path / "sp.gguf", hf_weights(vocab=len(vocab["tokens"])), tokenizer=vocab)
    ours = load_model(path, progress=False).tokenizer
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["hello world", "hello  world", "héllo wörld", " hello", "<think>hello</s>", "\n"]:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text), skip_special_tokens=True)
    joined = b"".join(ours.token_bytes(i) for i in ours.encode("héllo wörld", add_special_tokens=False))
    assert joined.lstrip(b" ") == "héllo wörld".encode()


def test_unknown_pre_tokenizer_is_rejected(tmp_path):
    vocab = byte_level_vocab() | {"pre": "some-future-model"}
    with pytest.raises(ModelLoadError, match="some-future-model"):
        load_model(write_gguf(tmp_path / "x.gguf", hf_weights(), tokenizer=vocab), progress=False)


def test_unknown_tokenizer_model_is_rejected(tmp_path):
    vocab = byte_level_vocab() | {"model": "bert"}
    with pytest.raises(ModelLoadError, match="'bert' is not supported"):
        load_model(write_gguf(tmp_path / "x.gguf", hf_weights(), tokenizer=vocab), progress=False)


def test_token_bytes_of_byte_level_tokens(smollm2):
    tok = smollm2  # logprobs report these bytes, so a token holding half a character is reported truly
    text = "naïve café 😀 <|im_end|>"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    emoji = tok.encode("😀")
    assert len(emoji) > 1 and all(tok.token_bytes(i).decode("utf-8", "replace") != "😀" for i in emoji)
