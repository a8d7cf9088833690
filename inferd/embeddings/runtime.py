"""The embedding runtime: inputs to token ids (lengths checked), batches through our BERT, vectors out.

Texts are tokenized without special tokens and token-id inputs taken as such content tokens; both are then
wrapped in the model's special tokens ([CLS] ... [SEP]), so a text and its token ids embed alike, and the
token counts (usage, the length limit) include those special tokens. The batcher sorts its window by
length, so a batch is padded to about its own length only.
"""
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from inferd.embeddings.config import EmbeddingConfig
from inferd.models.bert import BertEncoder, load_weights, pool
from inferd.models.cores import CoreShare, allowed_cpus
from inferd.kernels.select import native_bf16
from inferd.models.packed import pack_linears
from inferd.models.sentence import EmbeddingModelFiles, load_embedding_model
from inferd.protocol.embeddings import EmbeddingShape, checked_contents, checked_dimensions, content_ids
from inferd.protocol.errors import InvalidRequest
from inferd.protocol.headers import PriorityClass
from inferd.replica.batcher import Batcher, BatcherConfig, BatchReport

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str) -> torch.dtype:
    """auto: bf16 where the CPU multiplies it natively; measured 2.0-2.3x faster than fp32 for all-MiniLM-L6-v2
    on Zen 4 with AVX-512 BF16 (benchmarks/results/embeddings.md)."""
    if name == "auto":
        return torch.bfloat16 if native_bf16() else torch.float32
    return DTYPES[name]


@dataclass(slots=True)
class EmbeddingInfo:
    name: str
    dimensions: int
    max_input_tokens: int
    matryoshka: bool
    vocab_size: int
    dtype: str
    source_path: str
    digests: dict[str, str] = field(default_factory=dict)


class EmbeddingRuntime:
    """Owns the encoder and its batcher; start() and stop() on the event loop that calls embed()."""

    def __init__(self, files: EmbeddingModelFiles, config: EmbeddingConfig, served_model_name: str | None = None,
                 on_batch: Callable[[BatchReport], None] | None = None):
        self.cores = CoreShare.of_this_process(config.num_threads or len(allowed_cpus()), config.adapt_threads)
        self.config, self.dtype = config, resolve_dtype(config.dtype)
        self.tokenizer, self.pooling, self.normalize = files.tokenizer, files.pooling, files.normalize
        self.encoder = BertEncoder(files.config)
        load_weights(self.encoder, files.weights)
        self.encoder.eval().to(self.dtype)
        if config.pack_weights:
            pack_linears(self.encoder, self.dtype)
        self.info = EmbeddingInfo(served_model_name or files.name, files.dimensions, files.max_input_tokens,
                                  config.matryoshka, files.config.vocab_size, str(self.dtype).removeprefix("torch."),
                                  str(files.source), dict(files.digests))
        self.prefix, self.suffix = special_tokens(files.tokenizer)
        self.shape = EmbeddingShape(files.dimensions, files.max_input_tokens, len(self.prefix) + len(self.suffix),
                                    config.matryoshka)
        self.batcher: Batcher[list[int], torch.Tensor] = Batcher(self.embed_batch, BatcherConfig(
            max_batch_cost=config.max_batch_tokens, max_batch_items=config.max_batch_inputs,
            max_queue_delay_ms=config.max_queue_delay_ms, max_queue_items=config.max_queue_inputs,
            max_queue_cost=config.max_queue_tokens, sort_by_cost=True), on_batch=on_batch)

    @classmethod
    def load(cls, source=None, config: EmbeddingConfig | None = None, served_model_name: str | None = None,
             on_batch: Callable[[BatchReport], None] | None = None) -> "EmbeddingRuntime":
        return cls(load_embedding_model(source), config or EmbeddingConfig(), served_model_name, on_batch)

    def start(self) -> None:
        self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()

    # inputs to token ids

    def tokenize(self, inputs: list[str] | list[list[int]], truncate: bool | None = None) -> list[list[int]]:
        """Token ids with the special tokens; raises InvalidRequest for an out-of-vocabulary id, and
        ContextLengthExceeded for an input too long, unless truncate (default: the config's)."""
        contents = content_ids(self.tokenizer, inputs)
        if inputs and not isinstance(inputs[0], str):
            self._check_vocabulary(contents)
        cut = self.config.truncate if truncate is None else truncate
        return [self.prefix + list(c) + self.suffix for c in checked_contents(contents, self.shape, cut)]

    def _check_vocabulary(self, contents: list[list[int]]) -> None:
        for i, content in enumerate(contents):
            if max(content) >= self.info.vocab_size:
                raise InvalidRequest(f"Input {i} holds token id {max(content)}; this model's vocabulary has "
                                     f"{self.info.vocab_size} ids (0 to {self.info.vocab_size - 1}).", param="input")

    def check_dimensions(self, dimensions: int | None) -> int:
        return checked_dimensions(dimensions, self.shape)

    # embedding

    async def embed(self, token_ids: list[list[int]], priority: PriorityClass = "interactive",
                    deadline_s: float | None = None, dimensions: int | None = None) -> torch.Tensor:
        """[len(token_ids), dimensions] float32; inputs may run in several batches."""
        vectors = torch.stack(await self.batcher.run(token_ids, [len(t) for t in token_ids], priority, deadline_s))
        if dimensions is None or dimensions == self.info.dimensions:
            return vectors
        return F.normalize(vectors[:, :dimensions], dim=-1)

    def embed_batch(self, batch: list[list[int]]) -> list[torch.Tensor]:
        """One model batch, padded to its longest input (the worker thread calls it)."""
        if (threads := self.cores.threads()) != torch.get_num_threads():
            torch.set_num_threads(threads)
        width = max(len(ids) for ids in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.bool)
        for row, tokens in enumerate(batch):
            ids[row, :len(tokens)] = torch.tensor(tokens)
            mask[row, :len(tokens)] = True
        with torch.inference_mode():
            pooled = pool(self.encoder(ids, mask), mask, self.pooling)
            if self.normalize:
                pooled = F.normalize(pooled, dim=-1)
        return list(pooled.unbind(0))


def special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after a single input's content."""
    content = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(content) + 1):
        if full[start:start + len(content)] == content:
            return full[:start], full[start + len(content):]
    raise ValueError("the tokenizer's special tokens wrap the content in a way inferd cannot reproduce")
