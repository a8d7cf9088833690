"""`inferd eval run|compare`."""
import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from inferd.eval.docset import DEFAULT_SET, SPLITS, SetError

EXIT_BELOW_FLOOR, EXIT_USAGE = 1, 2


def add_eval_parser(commands: argparse._SubParsersAction) -> None:
    ev = commands.add_parser("eval", help="quality: run a versioned evaluation set against an endpoint")
    actions = ev.add_subparsers(dest="eval_command", required=True)
    run = actions.add_parser("run", help="run a set through the OpenAI chat API (greedy); JSON and Markdown "
                             "report; exit 1 below --floor")
    run.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root or its /v1")
    run.add_argument("--api-key", default=os.environ.get("INFERD_API_KEY"), help="default: $INFERD_API_KEY")
    run.add_argument("--model", required=True)
    run.add_argument("--set", type=Path, default=DEFAULT_SET, help="the set's folder (default: evals/docqa-v1)")
    run.add_argument("--split", choices=SPLITS, default="acceptance")
    run.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    run.add_argument("--limit", type=int, default=None, help="only the first N items of each behaviour")
    run.add_argument("--floor", default="", help="e.g. answer=0.3,decline=0.5 (answer, decline, conflict, "
                     "citation, overall): exit 1 when an accuracy is below")
    run.add_argument("--out", type=Path, default=Path("eval"), help="prefix: OUT.json and OUT.md")
    compare = actions.add_parser("compare", help="B against A: per-metric deltas with intervals, flipped items")
    compare.add_argument("a", type=Path)
    compare.add_argument("b", type=Path)
    compare.add_argument("--out", type=Path, default=None, help="also write OUT.json and OUT.md")


def run_eval(args: argparse.Namespace) -> int:
    from inferd.eval.report import compare, compare_markdown, markdown, parse_floor, write
    if args.eval_command == "compare":
        c = compare(json.loads(args.a.read_text()), json.loads(args.b.read_text()))
        text = compare_markdown(c, str(args.a), str(args.b))
        if args.out is not None:
            args.out.with_name(args.out.name + ".json").write_text(json.dumps(c, indent=2) + "\n")
            args.out.with_name(args.out.name + ".md").write_text(text)
        print(text, end="")
        return 0
    from inferd.eval.evaluate import evaluate
    try:
        floor = parse_floor(args.floor)
        rep = asyncio.run(evaluate(args.base_url, args.api_key, args.model, args.set, args.split, floor,
                                   args.concurrency, args.limit))
    except (ValueError, SetError) as exc:
        print(f"inferd eval: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    js, md = write(rep, args.out)
    print(markdown(rep).split("\n## Items")[0].rstrip())
    print(f"\nwrote {js} and {md}")
    for line in rep["below_floor"]:
        print(f"inferd eval: below the floor: {line}", file=sys.stderr)
    return EXIT_BELOW_FLOOR if rep["below_floor"] else 0
