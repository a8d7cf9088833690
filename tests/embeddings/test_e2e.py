"""/v1/embeddings through a real `inferd serve` (the shared server: SmolLM2 and all-MiniLM-L6-v2), called with
the official openai client: the contract, the gateway's limits and usage records."""

import numpy as np
import openai
import pytest
from sqlalchemy import create_engine, text

from tests.conftest import SMOLLM2_KEY
from tests.minilm import TEXTS, sentence_transformer
from tests.server import db_url, new_tenant_key, wait_stored

MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


def client(url: str, key: str = SMOLLM2_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def test_listed_with_its_kind_and_shape(server):
    cards = {m.id: m for m in client(server[0]).models.list().data}
    card = cards[MODEL].model_dump()
    assert (card["kind"], card["dimensions"], card["max_input_tokens"]) == ("embedding", 384, 256)
    assert card["digests"]["weights"] and cards["SmolLM2-135M-Instruct"].model_dump()["kind"] == "text"


def test_float_and_base64_agree_and_match_sentence_transformers(server):
    c = client(server[0])
    as_floats = c.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    as_base64 = c.embeddings.create(model=MODEL, input=TEXTS)  # the SDK's default: base64, decoded by it
    assert np.array_equal(vectors(as_floats), vectors(as_base64))
    expected = sentence_transformer().encode(TEXTS, normalize_embeddings=True)
    cosines = (vectors(as_floats) * expected).sum(axis=1)
    assert cosines.min() >= 0.999  # bf16 where the CPU has it, else fp32 (>= 0.9999 there)
    assert [d.index for d in as_floats.data] == list(range(len(TEXTS)))
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens > len(TEXTS)


def test_token_ids_one_hundred_inputs_and_dimensions(server):
    c = client(server[0])
    ids = sentence_transformer().tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    by_ids = vectors(c.embeddings.create(model=MODEL, input=ids, encoding_format="float"))
    by_text = vectors(c.embeddings.create(model=MODEL, input="Hello world", encoding_format="float"))
    assert np.allclose(by_ids, by_text, atol=1e-6)
    many = c.embeddings.create(model=MODEL, input=[f"sentence number {i}" for i in range(100)])
    assert len(many.data) == 100 and [d.index for d in many.data] == list(range(100))
    assert len(c.embeddings.create(model=MODEL, input="x", dimensions=384).data[0].embedding) == 384
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model=MODEL, input="x", dimensions=100)
    assert e.value.body["param"] == "dimensions"


@pytest.mark.parametrize("bad, param", [("", "input"), ([], "input"), (["ok", 3], "input"),
                                        ("word " * 300, "input")])
def test_bad_input_is_a_400_in_the_error_shape(server, bad, param):
    with pytest.raises(openai.BadRequestError) as e:
        client(server[0]).embeddings.create(model=MODEL, input=bad)
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


def test_a_too_long_input_names_its_index_unless_truncated(server):
    c = client(server[0])
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model=MODEL, input=["short", "word " * 300])
    assert "Input 1 has 302 tokens" in e.value.body["message"]
    cut = c.embeddings.create(model=MODEL, input=["short", "word " * 300], extra_body={"truncate": True})
    assert len(cut.data) == 2 and cut.usage.prompt_tokens == 3 + 256


def test_access_lists_rate_limits_and_usage_records(server):
    url, log_path = server
    chat_only = new_tenant_key(log_path, "chat-only", "--models", "SmolLM2-135M-Instruct")
    with pytest.raises(openai.PermissionDeniedError):
        client(url, chat_only).embeddings.create(model=MODEL, input="hi")
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "wrong_model_kind"
    tiny = new_tenant_key(log_path, "tiny-tpm", "--tpm", "20")
    first = client(url, tiny).embeddings.create(model=MODEL, input="hello there")
    with pytest.raises(openai.RateLimitError) as e:
        for _ in range(5):
            client(url, tiny).embeddings.create(model=MODEL, input="hello there, how are you today?")
    assert e.value.response.headers["retry-after"]
    wait_stored(url)
    engine = create_engine(db_url(log_path))
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT u.status, u.prompt_tokens, u.model FROM usage_records u JOIN tenants t ON t.id = u.tenant_id "
            "WHERE t.name = 'tiny-tpm' ORDER BY u.started_unix_s")).all()
    engine.dispose()
    assert rows[0] == ("completed", first.usage.prompt_tokens, MODEL)
    assert rows[-1][0] == "rejected" and all(r.model == MODEL for r in rows)
