"""The benchmark scenarios: each script here that runs on its own is one, run by its name with its own flags.

    PYTHONPATH=. .venv/bin/python -m benchmarks --list
    PYTHONPATH=. .venv/bin/python -m benchmarks burst --rounds 3 --out benchmarks/results/burst.json
    PYTHONPATH=. .venv/bin/python -m benchmarks burst --help

Every result a scenario writes carries its machine (machine.describe()); benchmarks/README.md says what each
found, by date.
"""
import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).parent


def scenarios() -> dict[str, str]:
    """Each scenario's name and the first line of its docstring: the scripts that run as a program."""
    out = {}
    for path in sorted(HERE.glob("*.py")):
        text = path.read_text()
        if path.stem.startswith("_") or '__name__ == "__main__"' not in text:
            continue  # a helper the scenarios share (machine.py, venvs.py, ...)
        out[path.stem] = (ast.get_docstring(ast.parse(text)) or "").strip().split("\n", 1)[0]
    return out


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("--list", "-l"):
        named = scenarios()
        width = max(map(len, named))
        print("\n".join(f"{name:<{width}}  {line}" for name, line in named.items()))
        return 0
    if argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv[0] not in scenarios():
        print(f"benchmarks: no scenario named {argv[0]!r} (--list names them)", file=sys.stderr)
        return 2
    sys.argv = [str(HERE / f"{argv[0]}.py"), *argv[1:]]
    runpy.run_module(f"benchmarks.{argv[0]}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
