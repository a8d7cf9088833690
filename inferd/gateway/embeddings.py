"""The embedding kind at the gateway: /v1/embeddings counted in the model's own tokens and refused early."""
from inferd.gateway.charges import Plan, check_request_limits
from inferd.gateway.config import ModelPrice
from inferd.gateway.deployments import Deployment
from inferd.gateway.kinds import Operation
from inferd.gateway.policy import KeyPolicy
from inferd.protocol.embeddings import checked_contents, checked_dimensions, content_ids, num_tokens
from inferd.protocol.openai import EmbeddingRequest


def plan(d: Deployment, key: KeyPolicy, body: EmbeddingRequest, raw: dict, price: ModelPrice) -> Plan:
    """The inputs' tokens (what TPM, budgets and the bill count), checked against the model's length and
    dimensions before any replica sees them."""
    m = d.model
    truncate = m.truncate if body.truncate is None else body.truncate
    contents = checked_contents(content_ids(m.tokenizer, body.inputs()), m.shape, truncate)
    checked_dimensions(body.dimensions, m.shape)
    tokens = num_tokens(contents, m.shape)
    check_request_limits(key, d.name, tokens, None, "input")
    return Plan(tokens, 0, 0, price.cost_usd(tokens, 0, 0), dict(raw, model=d.upstream_model or d.name), False)


OPERATIONS = (Operation("embeddings", "/v1/embeddings", EmbeddingRequest, "embedding", plan),)
