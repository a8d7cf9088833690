"""Running a set's items through an OpenAI-compatible chat endpoint, greedy, and scoring every reply."""
import asyncio
import time
from dataclasses import asdict, dataclass

import httpx

from inferd.eval.docset import EvalSet, Item, Template
from inferd.eval.scoring import Verdict, score

REQUEST_TIMEOUT_S = 300.0


@dataclass(slots=True)
class ItemResult:
    id: str
    behaviour: str
    domain: str
    passed: bool
    reason: str
    cited: bool | None
    reply: str | None  # None: the request failed (reason says how)
    e2e_s: float
    completion_tokens: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def chat_url(base_url: str) -> str:
    """BASE (the server's root or its /v1) -> BASE/v1/chat/completions."""
    base = base_url.rstrip("/")
    return f"{base.removesuffix('/v1')}/v1/chat/completions"


def request_body(template: Template, item: Item, model: str) -> dict:
    return {"model": model, "messages": template.messages(item), "max_tokens": template.max_tokens,
            "temperature": 0, "seed": 0}


async def ask(client: httpx.AsyncClient, url: str, api_key: str | None, model: str, template: Template,
              item: Item) -> ItemResult:
    """One item: the request, then its verdict; a failed request is a failed item with the error as reason."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.monotonic()
    try:
        r = await client.post(url, json=request_body(template, item, model), headers=headers,
                              timeout=REQUEST_TIMEOUT_S)
        r.raise_for_status()
        body = r.json()
        reply = body["choices"][0]["message"]["content"] or ""
        tokens = int(body.get("usage", {}).get("completion_tokens", 0))
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        detail = f"HTTP {exc.response.status_code}" if isinstance(exc, httpx.HTTPStatusError) else type(exc).__name__
        return ItemResult(item.id, item.behaviour, item.domain, False, f"request failed: {detail}", None, None,
                          time.monotonic() - start)
    v: Verdict = score(item, reply, template.cite)
    return ItemResult(item.id, item.behaviour, item.domain, v.passed, v.reason, v.cited, reply,
                      time.monotonic() - start, tokens)


async def run_items(base_url: str, api_key: str | None, model: str, evalset: EvalSet, items: list[Item],
                    concurrency: int = 4, client: httpx.AsyncClient | None = None) -> list[ItemResult]:
    """Every item, at most `concurrency` at once; results in the items' order."""
    gate = asyncio.Semaphore(max(concurrency, 1))
    url = chat_url(base_url)

    async def one(c: httpx.AsyncClient, item: Item) -> ItemResult:
        async with gate:
            return await ask(c, url, api_key, model, evalset.template, item)

    if client is not None:
        return list(await asyncio.gather(*(one(client, i) for i in items)))
    async with httpx.AsyncClient() as own:
        return list(await asyncio.gather(*(one(own, i) for i in items)))
