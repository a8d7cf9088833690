"""The embedding runtime: through its batcher, against sentence-transformers; tokens, lengths, dimensions."""
import asyncio

import pytest
import torch
import torch.nn.functional as F

from inferd.embeddings.config import EmbeddingConfig
from inferd.embeddings.runtime import EmbeddingRuntime
from inferd.protocol.errors import ContextLengthExceeded, InvalidRequest
from tests.minilm import TEXTS, minilm_files, sentence_transformer, text


def runtime(**settings) -> EmbeddingRuntime:
    return EmbeddingRuntime(minilm_files(), EmbeddingConfig(**settings))


def embedded(rt: EmbeddingRuntime, inputs, **kwargs) -> torch.Tensor:
    async def main():
        rt.start()
        try:
            return await rt.embed(rt.tokenize(inputs), **kwargs)
        finally:
            await rt.stop()
    return asyncio.run(main())


@pytest.fixture(scope="module")
def fp32() -> EmbeddingRuntime:
    return runtime(dtype="float32", max_batch_inputs=3)


@pytest.mark.parametrize("dtype, least", [("float32", 0.9999), ("bfloat16", 0.999)])
def test_batched_embeddings_equal_sentence_transformers(dtype, least):
    """Three inputs a batch: the eight inputs run in mixed-length batches, padded to the longest."""
    reference = sentence_transformer().encode(TEXTS, convert_to_tensor=True)
    ours = embedded(runtime(dtype=dtype, max_batch_inputs=3), TEXTS)
    assert ours.shape == (len(TEXTS), 384) and ours.dtype == torch.float32
    assert min(F.cosine_similarity(ours, reference).tolist()) >= least
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)


def test_auto_picks_bf16_only_where_the_cpu_multiplies_it_natively(monkeypatch):
    import inferd.embeddings.runtime as rt
    monkeypatch.setattr(rt, "native_bf16", lambda: False)
    assert rt.resolve_dtype("auto") == torch.float32
    monkeypatch.setattr(rt, "native_bf16", lambda: True)
    assert rt.resolve_dtype("auto") == torch.bfloat16 and rt.resolve_dtype("float32") == torch.float32


def test_token_ids_are_content_tokens_wrapped_like_text(fp32):
    content = minilm_files().tokenizer.encode(TEXTS[1], add_special_tokens=False).ids
    assert fp32.tokenize([content]) == fp32.tokenize([TEXTS[1]]) == [[101, *content, 102]]
    with pytest.raises(InvalidRequest, match="Input 1 holds token id 30522"):
        fp32.tokenize([[5], [30522]])


def test_too_long_inputs_are_refused_naming_the_input_unless_truncated(fp32):
    long = text(400)
    with pytest.raises(ContextLengthExceeded, match=r"Input 1 has \d+ tokens; this model reads at most 256"):
        fp32.tokenize(["short", long])
    [cut] = fp32.tokenize([long], truncate=True)
    assert len(cut) == 256 and cut[0] == 101 and cut[-1] == 102
    assert len(runtime(truncate=True).tokenize([long])[0]) == 256  # the server's setting
    with pytest.raises(ContextLengthExceeded):
        runtime(truncate=True).tokenize([long], truncate=False)  # the request's field wins
    reference = sentence_transformer().encode([long], convert_to_tensor=True)  # it truncates at 256 too
    ours = embedded(runtime(dtype="float32"), [cut[1:-1]])
    assert F.cosine_similarity(ours, reference).item() >= 0.9999


def test_dimensions_below_the_models_only_for_matryoshka():
    plain, matryoshka = runtime(), runtime(matryoshka=True, dtype="float32")
    assert plain.check_dimensions(None) == plain.check_dimensions(384) == 384
    for asked in (100, 385):
        with pytest.raises(InvalidRequest) as refused:
            plain.check_dimensions(asked)
        assert refused.value.param == "dimensions"
    assert matryoshka.check_dimensions(100) == 100
    full, short = embedded(matryoshka, TEXTS[:2]), embedded(matryoshka, TEXTS[:2], dimensions=100)
    assert short.shape == (2, 100) and torch.allclose(short, F.normalize(full[:, :100], dim=-1), atol=1e-6)
