"""Structured output: a JSON grammar (llguidance) masks a sequence's logits at every step.

A response format is compiled once into a matcher (cached, bounded) off the engine thread, when the
request arrives; each sequence runs its own copy. Each step the masks of the constrained sequences are
computed on llguidance's threads while the model runs its forward, then applied to their logit rows only.
"""
import logging
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from inferd.engine.request import GrammarError, ResponseFormat
from inferd.engine.sequence import Sequence
from inferd.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)
assert sys.byteorder == "little", "bitmasks are read as little-endian bytes"

MAX_CACHED_GRAMMARS = 128
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# whitespace between JSON tokens is free (small models write far better JSON when they may indent it), but a
# run of it is bounded, so that a model cannot loop on it forever
MAX_WHITESPACE = 24
# the logit bias of each byte of a bitmask (little-endian: bit i of byte b is token 8 b + i): 0 allowed, -inf not
BYTE_BIAS = np.array([[0.0 if byte >> i & 1 else -np.inf for i in range(8)] for byte in range(256)], np.float32)


# ---- compiling

class Vocabulary:
    """What llguidance's TokenizerWrapper reads: each token's bytes, the special ids, and an encoder."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: list[int]):
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.eos_token_id = eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        added = tokenizer.hf_tokenizer.get_added_tokens_decoder()
        self.special_token_ids = [i for i, token in added.items() if token.special]
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


class GrammarCompiler:
    """Compiled matchers, one per distinct response format (LRU-bounded). Thread-safe; compiles are serialized."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: list[int], max_cached: int = MAX_CACHED_GRAMMARS,
                 max_whitespace: int = MAX_WHITESPACE):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_cached = max_cached
        self.max_whitespace = max_whitespace  # characters in one run of whitespace between JSON tokens
        self._llg_tokenizer: llguidance.LLTokenizer | None = None  # built once, by warm() or on first use
        self._cache: OrderedDict[ResponseFormat, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, fmt: ResponseFormat) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence; raises GrammarError for a schema that cannot be compiled."""
        with self._lock:
            compiled = self._cache.get(fmt)
            self._cache[fmt] = compiled if compiled is not None else self._compile(fmt)
            self._cache.move_to_end(fmt)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return self._cache[fmt].deep_copy()

    def warm(self) -> None:
        """Builds llguidance's view of the vocabulary (0.6 s for 49k tokens) before any request waits for it."""
        with self._lock:
            if self.eos_token_ids:
                self._tokenizer()

    @property
    def vocab_size(self) -> int:
        return self._tokenizer().vocab_size

    def _compile(self, fmt: ResponseFormat) -> llguidance.LLMatcher:
        if fmt.type == "lark":
            grammar, what = llguidance.LLMatcher.grammar_from_lark(fmt.schema), "grammar"
        else:
            schema = fmt.schema if fmt.type == "json_schema" else JSON_OBJECT_SCHEMA
            options = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{self.max_whitespace}}}"}
            try:
                grammar, what = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options), "JSON schema"
            except ValueError as exc:
                raise GrammarError(f"the JSON schema must be a JSON object: {exc}") from exc
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {what} cannot be used: {matcher.get_error()}")
        return matcher

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._llg_tokenizer is None:
            if not self.eos_token_ids:
                raise GrammarError("this model has no end-of-sequence token, which structured output needs")
            vocab = llguidance.TokenizerWrapper(Vocabulary(self.tokenizer, self.eos_token_ids))
            self._llg_tokenizer = llguidance.LLTokenizer(vocab, eos_token=self.eos_token_ids)
        return self._llg_tokenizer


# ---- masking, each step

@dataclass(slots=True)
class PendingMasks:
    """One step's masks of the constrained rows, being computed while the forward runs."""
    rows: list[int]  # rows of the step's logits that are constrained
    bias: Future  # of float32 [len(rows), logits width]: 0 where the grammar allows a token, -inf elsewhere

    def apply(self, logits: torch.Tensor) -> None:
        """Sets the logits of tokens the grammar does not allow to -inf, in place (numpy: a row is too small
        for torch's thread pool, whose barrier alone can cost more than the add on a busy machine)."""
        rows, bias = logits.numpy(), self.bias.result()
        for j, i in enumerate(self.rows):
            rows[i] += bias[j]


class GrammarMasker:
    """Starts the masks of a step's constrained sequences on a worker thread, so they overlap the forward."""

    def __init__(self, compiler: GrammarCompiler, logits_width: int):
        self.compiler = compiler
        self.logits_width = logits_width  # the model's vocabulary, which may pad the tokenizer's
        self._executor: llguidance.LLExecutor | None = None
        self._worker: ThreadPoolExecutor | None = None

    def start(self, seqs: list[Sequence]) -> PendingMasks | None:
        """seqs: those sampling this step, in logits row order; None when none is constrained."""
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return None
        if self._worker is None:
            self._executor, self._worker = llguidance.LLExecutor(), ThreadPoolExecutor(1, "inferd-grammar")
        matchers = [(seqs[i].grammar, j) for j, i in enumerate(rows)]
        return PendingMasks(rows, self._worker.submit(self._bias, matchers))

    def _bias(self, matchers: list[tuple[llguidance.LLMatcher, int]]) -> np.ndarray:
        """On the worker: no torch ops here, whose thread pool would fight the forward's for the cores."""
        vocab_size = self.compiler.vocab_size
        bitmask = np.empty((len(matchers), (vocab_size + 31) // 32), dtype=np.int32)  # C-contiguous rows
        # what llguidance.torch.fill_next_token_bitmask_par does, without importing that module (its
        # torch.compile decorator costs every replica 1.6 s of start-up)
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.ctypes.data, bitmask.shape[1] * 4, len(matchers))
        bias = np.take(BYTE_BIAS, bitmask.view(np.uint8), axis=0).reshape(len(matchers), -1)
        if bias.shape[1] == vocab_size == self.logits_width:
            return bias
        padded = np.full((len(matchers), self.logits_width), -np.inf, np.float32)
        n = min(vocab_size, self.logits_width)
        padded[:, :n] = bias[:, :n]
        return padded


def accept_token(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Advances the matcher; False (logged) if the grammar rejected the token, which the mask should prevent."""
    if matcher.consume_token(token):
        return True
    log.error("structured output: the grammar rejected sampled token %d: %s", token, matcher.get_error())
    return False
