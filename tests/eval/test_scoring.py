"""The scoring rules on their own examples: normalising, the decline detector, conflicts, citations."""
import pytest

from inferd.eval.docset import Item
from inferd.eval.scoring import declines, normalise, notes_conflict, score

EXCERPTS = (("E1", "At Brindle Works, new employees receive 18 days of paid leave in their first year."),
            ("E2", "Brindle Works reimburses home office equipment up to $350 per employee."))
ANSWER = Item("a", "tuning", "hr", "answer", "How many days?", EXCERPTS, answers=("18", "eighteen"),
              supporting=("E1",))
DECLINE = Item("d", "tuning", "hr", "decline", "How many days?", EXCERPTS)
CONFLICT = Item("c", "tuning", "hr", "conflict", "How many days?",
                (("E1", "New employees receive 18 days of paid leave."), ("E2", "New employees receive 22 days of "
                                                                          "paid leave.")),
                values=(("18", "eighteen"), ("22", "twenty-two")))


def test_normalise():
    assert normalise("The fee is £6.20 [E2].") == "the fee is 6 20"
    assert normalise("15,000 RPM; 2GB; 5%") == "15000 rpm 2 gb 5 percent"
    assert normalise("Ctrl+Shift+N") == "ctrl shift n"
    assert normalise("Can't ANSWER — sign-in") == "can t answer sign in"


DECLINES = ["I cannot answer from these excerpts.", "I can't answer that from the excerpts given.",
            "The excerpts do not contain this information.", "There is no information about paid leave.",
            "This is not mentioned in the excerpts.", "I don't know.", "None of the excerpts says how many days."]
ANSWERS = ["18 days [E1]", "New employees receive 18 days of paid leave.", "The answer is eighteen.",
           "The excerpts contain the answer: 18.", "Paid leave is given in days; 18 of them."]


@pytest.mark.parametrize("reply", DECLINES)
def test_the_decline_detector_finds_declines(reply):
    assert declines(reply)


@pytest.mark.parametrize("reply", ANSWERS)
def test_the_decline_detector_passes_answers(reply):
    assert not declines(reply)


@pytest.mark.parametrize("reply,noted", [("The excerpts disagree.", True), ("E1 and E2 conflict.", True),
                                         ("They give different numbers.", True), ("These contradict.", True),
                                         ("The answer is 18 [E1].", False), ("I cannot answer.", False)])
def test_the_conflict_detector(reply, noted):
    assert notes_conflict(reply) is noted


def test_answer_items():
    assert score(ANSWER, "18 days [E1]", cite=True).passed and score(ANSWER, "18 days [E1]", True).cited
    assert score(ANSWER, "Eighteen days.", cite=True) == score(ANSWER, "Eighteen days.", True)
    assert not score(ANSWER, "Eighteen days.", True).cited and score(ANSWER, "Eighteen days.", False).cited is None
    assert score(ANSWER, "118 days", True).reason == "no accepted answer"  # whole numbers only
    assert score(ANSWER, "I cannot answer; maybe 18.", True).reason == "declined an answerable question"
    echo = " ".join(f"[{i}] {t}" for i, t in EXCERPTS)
    assert score(ANSWER, echo, True).reason == "quoted every excerpt"


def test_decline_items():
    assert score(DECLINE, "I cannot answer from these excerpts.", True).passed
    assert score(DECLINE, "18 days [E1]", True).reason == "answered"


def test_conflict_items():
    assert score(CONFLICT, "The excerpts disagree.", True).reason == "noted the conflict"
    assert score(CONFLICT, "Either 18 or twenty-two days.", True).reason == "gave both values"
    assert score(CONFLICT, "18 days.", True).reason == "gave one value"
    assert score(CONFLICT, "I cannot answer from these excerpts.", True).reason == \
        "declined without naming the conflict"
    echo = "[E1] New employees receive 18 days of paid leave. [E2] New employees receive 22 days of paid"
    assert score(CONFLICT, echo, True).reason == "quoted every excerpt"
    assert score(CONFLICT, "New employees receive 22 days of paid leave.", True).reason == "gave one value"
