"""Builds items.jsonl from facts.yaml: `python evals/docqa-v1/build.py` (deterministic; the test suite checks
that the committed items.jsonl is what this writes).

Each fact gives three items (README.md): answer, decline and conflict. Facts 1, 4 and 7 of every domain are
the tuning split, the others the acceptance split, so no question is in both."""
import json
from pathlib import Path

import yaml

HERE = Path(__file__).parent
TUNING = (0, 3, 6)  # fact positions within a domain


def excerpt(fact: dict, value: str) -> str:
    return fact["text"].format(value)


def items_of(domain: str, facts: list[dict], i: int) -> list[dict]:
    fact, after, later = facts[i], facts[(i + 1) % len(facts)], facts[(i + 2) % len(facts)]
    right, other = excerpt(fact, fact["answer"][0]), excerpt(after, after["answer"][0])
    first = i % 2 == 0  # the supporting (or first-value) excerpt is E1 on even facts, E2 on odd ones
    values = [fact["answer"], fact["alt"]] if first else [fact["alt"], fact["answer"]]
    return [
        _item(domain, i, fact, "answer", [right, other] if first else [other, right],
              answers=fact["answer"], supporting=["E1" if first else "E2"]),
        _item(domain, i, fact, "decline", [other, excerpt(later, later["answer"][0])]),
        _item(domain, i, fact, "conflict", [excerpt(fact, v[0]) for v in values], values=values),
    ]


def _item(domain: str, i: int, fact: dict, behaviour: str, texts: list[str], **expected) -> dict:
    return {"id": f"{domain}-{i + 1:02d}-{behaviour}", "split": "tuning" if i in TUNING else "acceptance",
            "domain": domain, "behaviour": behaviour, "question": fact["question"],
            "excerpts": [{"id": f"E{k + 1}", "text": t} for k, t in enumerate(texts)]} | expected


def build() -> str:
    facts = yaml.safe_load((HERE / "facts.yaml").read_text())
    items = [item for domain, rows in facts.items() for i in range(len(rows)) for item in items_of(domain, rows, i)]
    return "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)


if __name__ == "__main__":
    (HERE / "items.jsonl").write_text(build())
