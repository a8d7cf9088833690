"""One evaluation: a set's split against an endpoint, scored, summarised and held against a floor."""
import time
from pathlib import Path

import httpx

from inferd.eval.docset import load_set
from inferd.eval.report import report
from inferd.eval.run import run_items


async def evaluate(base_url: str, api_key: str | None, model: str, set_path: str | Path, split: str | None,
                   floor: dict[str, float] | None = None, concurrency: int = 4, limit: int | None = None,
                   client: httpx.AsyncClient | None = None) -> dict:
    """The report (report.report's dict): summary, floor, what is below it, every item's reply and verdict.
    limit: the first N items of each behaviour only (tests; intervals grow accordingly)."""
    evalset = load_set(set_path)
    items = evalset.split(split, limit)
    start_unix_s, start = time.time(), time.monotonic()
    results = await run_items(base_url, api_key, model, evalset, items, concurrency, client)
    meta = {"set": evalset.name, "prompt_version": evalset.template.version, "split": split, "limit": limit,
            "model": model, "base_url": base_url, "started_unix_s": start_unix_s,
            "duration_s": time.monotonic() - start}
    return report(meta, results, floor or {})
