"""An evaluation set on disk: a folder with items.jsonl (one item per line) and prompt.json (the versioned
template that turns an item into chat messages). docqa-v1's README describes the fields."""
import json
from dataclasses import dataclass
from pathlib import Path

from inferd.eval.jsonl import jsonl_lines

BEHAVIOURS = ("answer", "decline", "conflict")
SPLITS = ("tuning", "acceptance")
DEFAULT_SET = Path(__file__).resolve().parents[2] / "evals" / "docqa-v1"  # in a source checkout


class SetError(ValueError):
    """A set folder, item or split that cannot be used; the message names the file and line."""


@dataclass(slots=True, frozen=True)
class Item:
    id: str
    split: str
    domain: str
    behaviour: str  # answer | decline | conflict
    question: str
    excerpts: tuple[tuple[str, str], ...]  # (id, text)
    answers: tuple[str, ...] = ()  # answer: accepted forms, matched after normalising
    answer_regex: str | None = None  # answer: or a regex over the raw reply
    supporting: tuple[str, ...] = ()  # answer: the excerpt ids that hold it
    values: tuple[tuple[str, ...], ...] = ()  # conflict: each excerpt's value, as accepted forms


@dataclass(slots=True, frozen=True)
class Template:
    version: str
    system: str
    user: str  # with {excerpts} and {question}
    excerpt: str  # with {id} and {text}
    cite: bool  # the prompt asks for excerpt ids: answers are checked for them
    max_tokens: int

    def messages(self, item: Item) -> list[dict]:
        excerpts = "\n".join(self.excerpt.format(id=i, text=t) for i, t in item.excerpts)
        return [{"role": "system", "content": self.system},
                {"role": "user", "content": self.user.format(excerpts=excerpts, question=item.question)}]


@dataclass(slots=True, frozen=True)
class EvalSet:
    name: str  # the folder's name, e.g. docqa-v1
    template: Template
    items: tuple[Item, ...]

    def split(self, split: str | None, limit: int | None = None) -> list[Item]:
        """The split's items in file order (None: all), the first `limit` of each behaviour if given."""
        if split is not None and split not in SPLITS:
            raise SetError(f"unknown split {split!r} (splits: {', '.join(SPLITS)})")
        chosen = [i for i in self.items if split is None or i.split == split]
        if limit is not None:
            chosen = [i for b in BEHAVIOURS for i in [i for i in chosen if i.behaviour == b][:limit]]
            chosen.sort(key=self.items.index)
        return chosen


def load_set(folder: str | Path) -> EvalSet:
    folder = Path(folder).expanduser()
    try:
        template = Template(**json.loads((folder / "prompt.json").read_text()))
        lines = jsonl_lines((folder / "items.jsonl").read_text())
    except (OSError, TypeError, ValueError) as exc:
        raise SetError(f"{folder}: {exc}") from None
    items = tuple(_item(line, f"{folder / 'items.jsonl'}:{n}") for n, line in lines)
    if len({i.id for i in items}) != len(items):
        raise SetError(f"{folder / 'items.jsonl'}: item ids repeat")
    return EvalSet(folder.name, template, items)


def _item(line: str, where: str) -> Item:
    try:
        raw = json.loads(line)
        raw["excerpts"] = tuple((e["id"], e["text"]) for e in raw["excerpts"])
        raw["values"] = tuple(tuple(v) for v in raw.get("values", ()))
        for name in ("answers", "supporting"):
            raw[name] = tuple(raw.get(name, ()))
        item = Item(**raw)
    except (ValueError, TypeError, KeyError) as exc:
        raise SetError(f"{where}: {exc}") from None
    ok = {"answer": bool(item.answers or item.answer_regex), "decline": True, "conflict": len(item.values) >= 2}
    if item.behaviour not in BEHAVIOURS or item.split not in SPLITS or not ok[item.behaviour]:
        raise SetError(f"{where}: {item.id}: a {item.behaviour!r} item of split {item.split!r} without what it "
                       "needs (answer: answers or answer_regex; conflict: two values)")
    return item
