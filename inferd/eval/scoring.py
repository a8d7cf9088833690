"""Deterministic scoring of one reply (docqa-v1's README explains each rule).

normalise: NFKC, lower case, excerpt citations ([E1]) out, thousands commas joined (15,000 -> 15000),
% -> percent, digits split from letters (2GB -> 2 gb), every other non-alphanumeric character a space.
An expected form matches when its normalised words occur, whole and in order, in the normalised reply.
"""
import re
import unicodedata
from dataclasses import dataclass

from inferd.eval.docset import Item

CITATION = re.compile(r"\[?\b[Ee](\d+)\b\]?")
# a reply that says it cannot answer from the excerpts (matched as whole normalised words)
DECLINE_PHRASES = (
    "cannot answer", "can not answer", "can t answer", "unable to answer", "not able to answer",
    "cannot be answered", "can t be answered", "cannot tell", "can t tell", "cannot determine",
    "cannot be determined", "can t be determined", "do not contain", "does not contain", "don t contain",
    "doesn t contain", "do not say", "does not say", "don t say", "doesn t say", "do not mention",
    "does not mention", "don t mention", "doesn t mention", "not mentioned", "no information",
    "not enough information", "not provided", "not stated", "not specified", "not given", "i do not know",
    "i don t know", "none of the excerpts", "no excerpt", "not in the excerpts")
# a reply that says the excerpts disagree (matched as word beginnings: differ matches differs, different)
CONFLICT_STEMS = ("disagree", "conflict", "contradict", "inconsisten", "discrepan", "differ", "do not agree",
                  "don t agree", "not consistent", "two values", "two answers")


def normalise(text: str) -> str:
    text = CITATION.sub(" ", unicodedata.normalize("NFKC", text).lower())
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text).replace("%", " percent ")
    text = re.sub(r"(?<=\d)(?=[a-z])|(?<=[a-z])(?=\d)", " ", text)
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text).split())


def contains(reply_norm: str, form: str, stem: bool = False) -> bool:
    """Whether the normalised words of form occur whole (stem: the last one may run on) in the reply."""
    words = normalise(form)
    return bool(words) and re.search(rf"(?<![0-9a-z]){re.escape(words)}{'' if stem else '(?![0-9a-z])'}",
                                     reply_norm) is not None


def declines(reply: str) -> bool:
    norm = normalise(reply)
    return any(contains(norm, p) for p in DECLINE_PHRASES)


def notes_conflict(reply: str) -> bool:
    norm = normalise(reply)
    return any(contains(norm, s, stem=True) for s in CONFLICT_STEMS)


def citations(reply: str) -> set[str]:
    return {f"E{n}" for n in CITATION.findall(reply)}


def quotes_every_excerpt(reply: str, item: Item, words: int = 6) -> bool:
    """The reply repeats the start (`words` normalised words) of every excerpt, each at its own place: it
    quotes, it does not answer. (Excerpts that begin alike, as a conflict's do, need two quotes, not one.)"""
    norm = normalise(reply)
    starts = [{m.start() for m in re.finditer(rf"(?<![0-9a-z]){re.escape(' '.join(normalise(t).split()[:words]))}",
                                              norm)} for _, t in item.excerpts]
    return len(item.excerpts) > 1 and all(starts) and len(set().union(*starts)) >= len(item.excerpts)


@dataclass(slots=True, frozen=True)
class Verdict:
    passed: bool
    reason: str  # why, in a few words
    cited: bool | None = None  # answer items under a citing template: the reply cites a supporting excerpt


def score(item: Item, reply: str, cite: bool) -> Verdict:
    return {"answer": _answer, "decline": _decline, "conflict": _conflict}[item.behaviour](item, reply, cite)


def _answer(item: Item, reply: str, cite: bool) -> Verdict:
    cited = bool(citations(reply) & set(item.supporting)) if cite else None
    norm = normalise(reply)
    matched = any(contains(norm, f) for f in item.answers) or bool(
        item.answer_regex and re.search(item.answer_regex, reply))
    if quotes_every_excerpt(reply, item):
        return Verdict(False, "quoted every excerpt", cited)
    if declines(reply):
        return Verdict(False, "declined an answerable question", cited)
    if notes_conflict(reply):
        return Verdict(False, "claimed a conflict", cited)
    return Verdict(True, "answered", cited) if matched else Verdict(False, "no accepted answer", cited)


def _decline(item: Item, reply: str, cite: bool) -> Verdict:
    return Verdict(True, "declined") if declines(reply) else Verdict(False, "answered")


def _conflict(item: Item, reply: str, cite: bool) -> Verdict:
    norm = normalise(reply)
    if quotes_every_excerpt(reply, item):
        return Verdict(False, "quoted every excerpt")
    if notes_conflict(reply):
        return Verdict(True, "noted the conflict")
    given = sum(any(contains(norm, f) for f in forms) for forms in item.values)
    if given == len(item.values):
        return Verdict(True, "gave both values")
    if declines(reply):
        return Verdict(False, "declined without naming the conflict")
    return Verdict(False, "gave one value" if given else "gave neither value")
