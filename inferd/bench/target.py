from dataclasses import dataclass

import httpx

from inferd.bench.errors import EndpointError


@dataclass(slots=True)
class ModelCard:
    """What /v1/models says about the served model; inferd adds source_path, max_model_len and digests."""
    id: str
    source_path: str | None
    max_model_len: int | None
    digests: dict[str, str]

    def as_dict(self) -> dict:
        return {"id": self.id, "source_path": self.source_path, "max_model_len": self.max_model_len,
                "digests": self.digests}


def root_url(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


async def model_card(client: httpx.AsyncClient, base_url: str, api_key: str | None, model: str | None) -> ModelCard:
    """The card of model (or of the only/first model served)."""
    url = f"{root_url(base_url)}/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = await client.get(url, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise EndpointError(f"cannot reach {url} ({type(exc).__name__}: {exc}); is the server up?") from exc
    if response.status_code != 200:
        raise EndpointError(f"GET {url} answered {response.status_code}: {response.text[:200]}; "
                            "check --base-url and --api-key")
    cards = response.json().get("data") or []
    found = [c for c in cards if model is None or c.get("id") == model]
    if not found:
        raise EndpointError(f"the server does not serve {model!r}; it serves {[c.get('id') for c in cards]}")
    c = found[0]
    return ModelCard(c["id"], c.get("source_path"), c.get("max_model_len"), c.get("digests") or {})
