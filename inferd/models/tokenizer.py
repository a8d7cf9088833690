import json
import re
from dataclasses import dataclass, field
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from inferd.models.errors import ChatTemplateError, ModelLoadError

TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
CONTROL, USER_DEFINED = 3, 4
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3")
NFC_PRE = ("qwen2", "deepseek-r1-qwen", "megrez")
SPLIT_REGEX = {pre: LLAMA3_SPLIT for pre in LLAMA3_PRE} | {pre: QWEN2_SPLIT for pre in NFC_PRE}
DIGIT_SPLIT = ("smollm", "starcoder", "refact")
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_of_char() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode table that byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


BYTE_OF_CHAR = _byte_of_char()


# ---- chat template environment (same helpers Hugging Face templates expect)

def raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(f"the model's chat template does not compile (line {exc.lineno}: {exc.message}); "
                             "fix or replace the chat template") from exc


# ---- special ids

def unique_ids(ids: list[int | None]) -> list[int]:
    return list(dict.fromkeys(i for i in ids if i is not None))


def turn_end_token_ids(hf_tokenizer: HFTokenizer, chat_template: str | None) -> list[int]:
    """Ids of the end-of-turn tokens the chat template writes, e.g. <|im_end|> for ChatML."""
    if not chat_template:
        return []
    found = [hf_tokenizer.token_to_id(t) for t in TURN_END_TOKENS if t in chat_template]
    return unique_ids(found)


# ---- building from a vocabulary (names of pre-tokenizers as llama.cpp spells them)

def byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    vocab, pairs = {token: i for i, token in enumerate(tokens)}, [tuple(m.split(" ", 1)) for m in merges]
    hf = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=pre in LLAMA3_PRE))
    hf.pre_tokenizer = byte_level_pre_tokenizer(pre)
    hf.normalizer = normalizers.NFC() if pre in NFC_PRE else None
    hf.decoder = decoders.ByteLevel()
    return hf


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in ("default", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre in DIGIT_SPLIT:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in SPLIT_REGEX:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLIT_REGEX[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise ModelLoadError(f"pre-tokenizer {pre!r} is not supported; load the model's Hugging Face directory instead")


def sentencepiece_bpe(tokens: list[str], scores: list[float], unk: str | None, prefix: bool) -> HFTokenizer:
    """SentencePiece BPE as tokenizers BPE with byte fallback, merges ranked by token score."""
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = sentencepiece_merges(vocab, dict(zip(tokens, scores)))
    hf = HFTokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True, unk_token=unk))
    scheme = "first" if prefix else "never"
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    hf.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return hf


def sentencepiece_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best score first (as transformers' generate_merges)."""
    merges = []
    for token, score in scores.items():
        splits = ((token[:i], token[i:], score) for i in range(1, len(token)))
        pairs = [p for p in splits if p[0] in vocab and p[1] in vocab]
        merges.extend(sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]])))
    merges.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def add_vocab_special_tokens(hf: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens (<|im_start|>) as special tokens, user-defined ones as plain added tokens: both stay whole."""
    kinds = list(zip(tokens, types))
    hf.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in kinds if k == CONTROL])
    hf.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in kinds if k == USER_DEFINED])


# ---- tokenizer

@dataclass(slots=True)
class IncrementalDecoder:
    """Turns generated ids into text pieces; holds back bytes of an unfinished UTF-8 character."""
    hf_tokenizer: HFTokenizer
    stream: DecodeStream

    def step(self, token_id: int) -> str | None:
        return self.stream.step(self.hf_tokenizer, token_id)


@dataclass(slots=True)
class Tokenizer:
    """A model's tokenizer, its special ids and its chat template."""
    hf_tokenizer: HFTokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    add_bos: bool = False
    template: jinja2.Template | None = field(init=False, default=None, repr=False)

    def __post_init__(self):
        if self.chat_template:
            self.template = compile_chat_template(self.chat_template)

    @property
    def vocab_size(self) -> int:
        return self.hf_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.hf_tokenizer.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.hf_tokenizer.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; BOS first when the model wants it and the text does not start with it."""
        ids = self.hf_tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids  # no offsets: faster
        wants_bos = add_special_tokens and self.add_bos and self.bos_token_id is not None
        return [self.bos_token_id, *ids] if wants_bos and ids[:1] != [self.bos_token_id] else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for; a token holding part of a UTF-8 character gives that part."""
        piece = self.hf_tokenizer.id_to_token(token_id) or ""
        if isinstance(self.hf_tokenizer.decoder, decoders.ByteLevel) and all(c in BYTE_OF_CHAR for c in piece):
            return bytes(BYTE_OF_CHAR[c] for c in piece)
        if match := BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match[1], 16)])
        return piece.replace("\u2581", " ").encode()

    def new_decode_stream(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self.hf_tokenizer, DecodeStream(skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **template_kwargs) -> str:
        """The prompt text for a conversation, rendered with the model's own chat template."""
        if self.template is None:
            raise ChatTemplateError("this model has no chat template; send a raw prompt to /v1/completions "
                                    "or give the deployment a chat template")
        try:
            return self.template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                        **template_kwargs)
        except (jinja2.TemplateError, TypeError) as exc:
            raise ChatTemplateError(f"the model's chat template rejected the conversation: {exc}") from exc
