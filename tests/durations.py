"""Each test module's seconds in one run, for the order `make test` hands modules to its workers (tests/conftest.py:
the longest first, so that no long module is left to run alone at the end). Refresh after a full run with a JUnit
report:

    .venv/bin/python -m pytest -n 2 --dist loadfile --junitxml=junit.xml
    .venv/bin/python tests/durations.py junit.xml      # writes tests/durations.json
"""
import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

FILE = Path(__file__).with_name("durations.json")


def main(report: str) -> None:
    seconds: Counter = Counter()
    for case in ET.parse(report).iter("testcase"):
        parts = case.get("classname", "").split(".")
        while parts and parts[-1][:1].isupper():  # a test class's name
            parts.pop()
        module = "/".join(parts) + ".py"
        seconds[module] += float(case.get("time") or 0)
    FILE.write_text(json.dumps({m: round(s, 1) for m, s in sorted(seconds.items())}, indent=0) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
