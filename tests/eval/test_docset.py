"""docqa-v1 as committed: built from its facts, balanced, split without shared questions; intervals."""
import importlib.util
import math
from collections import Counter
from pathlib import Path

import pytest

from inferd.eval.docset import BEHAVIOURS, SetError, load_set
from inferd.eval.intervals import difference, wilson

SET = Path(__file__).parents[2] / "evals" / "docqa-v1"


def test_items_jsonl_is_what_build_py_writes():
    spec = importlib.util.spec_from_file_location("docqa_build", SET / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert (SET / "items.jsonl").read_text() == build.build()


def test_the_set_is_balanced_and_its_splits_share_no_question():
    s = load_set(SET)
    assert len(s.items) >= 150 and len({i.domain for i in s.items}) >= 5
    assert Counter(i.behaviour for i in s.items) == {b: len(s.items) // 3 for b in BEHAVIOURS}
    tuning, acceptance = s.split("tuning"), s.split("acceptance")
    assert len(tuning) + len(acceptance) == len(s.items) and len(acceptance) > len(tuning)
    assert not {i.question for i in tuning} & {i.question for i in acceptance}
    for item in (i for i in s.items if i.behaviour == "answer"):  # its answer is in its supporting excerpt
        assert item.answers[0] in dict(item.excerpts)[item.supporting[0]]
    limited = s.split("acceptance", limit=2)
    assert Counter(i.behaviour for i in limited) == {b: 2 for b in BEHAVIOURS}
    with pytest.raises(SetError):
        s.split("test")
    assert "[E1] " in s.template.messages(s.items[0])[1]["content"]


def test_a_broken_item_names_its_line(tmp_path):
    (tmp_path / "prompt.json").write_text((SET / "prompt.json").read_text())
    (tmp_path / "items.jsonl").write_text('{"id": "x", "split": "tuning", "domain": "d", "behaviour": "answer", '
                                          '"question": "q", "excerpts": []}\n')
    with pytest.raises(SetError, match="items.jsonl:1: x"):
        load_set(tmp_path)


def test_wilson_and_newcombe():
    low, high = wilson(8, 10)
    assert math.isclose(low, 0.4902, abs_tol=1e-3) and math.isclose(high, 0.9433, abs_tol=1e-3)
    assert wilson(0, 0) == (0.0, 1.0) and wilson(0, 10)[0] == 0.0
    delta, lo, hi = difference(0, 10, 8, 10)  # B = 0/10 vs A = 8/10: worse beyond the interval
    assert delta == -0.8 and hi < 0 and lo > -1
    delta, lo, hi = difference(5, 10, 6, 10)
    assert lo < 0 < hi
