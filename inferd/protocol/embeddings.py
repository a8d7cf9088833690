"""The embedding kind's input rules, applied by the gateway (to count tokens and refuse early) and by the
replica alike: token counts include the model's special tokens; a longer input is refused unless truncated;
`dimensions` is the native size, or smaller for a matryoshka model."""
from dataclasses import dataclass
from typing import Protocol

from inferd.protocol.errors import ContextLengthExceeded, InvalidRequest


class BatchTokenizer(Protocol):  # a `tokenizers.Tokenizer`
    def encode_batch(self, inputs: list[str], add_special_tokens: bool = True) -> list: ...


@dataclass(slots=True, frozen=True)
class EmbeddingShape:
    dimensions: int
    max_input_tokens: int  # special tokens included
    num_special_tokens: int  # what the model wraps each input's content in ([CLS] ... [SEP]: 2)
    matryoshka: bool = False  # trained for truncated embeddings: smaller dimensions allowed


def content_ids(tokenizer: BatchTokenizer, inputs: list[str] | list[list[int]]) -> list[list[int]]:
    """Each input's content tokens, without special tokens; token-id inputs are taken as content."""
    if inputs and isinstance(inputs[0], str):
        return [e.ids for e in tokenizer.encode_batch(inputs, add_special_tokens=False)]
    return inputs


def checked_contents(contents: list[list[int]], shape: EmbeddingShape, truncate: bool) -> list[list[int]]:
    """The contents that fit (cut where truncate); raises ContextLengthExceeded naming the input otherwise."""
    room = shape.max_input_tokens - shape.num_special_tokens
    for i, content in enumerate(contents):
        if len(content) > room and not truncate:
            raise ContextLengthExceeded(
                f"Input {i} has {len(content) + shape.num_special_tokens} tokens; this model reads at most "
                f"{shape.max_input_tokens} (special tokens included). Shorten it, or send \"truncate\": true "
                "to cut it.", param="input")
    return [c if len(c) <= room else c[:room] for c in contents]


def num_tokens(contents: list[list[int]], shape: EmbeddingShape) -> int:
    """What the request is billed and counted for: every input's tokens, special tokens included."""
    return sum(len(c) for c in contents) + shape.num_special_tokens * len(contents)


def checked_dimensions(dimensions: int | None, shape: EmbeddingShape) -> int:
    native = shape.dimensions
    if dimensions is None or dimensions == native:
        return native
    if dimensions > native:
        raise InvalidRequest(f"This model's embeddings have {native} dimensions; {dimensions} were asked for.",
                             param="dimensions")
    if not shape.matryoshka:
        raise InvalidRequest(f"This model's embeddings have {native} dimensions and it is not served as a "
                             f"matryoshka model, so they cannot be shortened to {dimensions}.", param="dimensions")
    return dimensions
