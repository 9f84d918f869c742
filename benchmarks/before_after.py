"""A benchmark script run on an earlier revision and on the working tree, alternately, in one run.

For refactors that must not get slower: the earlier revision is checked out into a temporary
git worktree, and the same script (its copy at each revision) runs there and here in turns, so
the machine's load falls on both alike. Prints one JSON object: each run's JSON output, and the
ratio after / before of the numeric figures named with --figure (dotted paths into the output).

    python benchmarks/before_after.py --before HEAD~1 --figure spec.ngram.speedup \\
        -- benchmarks/speculative.py --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(cwd: Path, script: list[str]) -> dict:
    out = subprocess.run([sys.executable, *script], cwd=cwd, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(cwd)})
    return json.loads(out.stdout[out.stdout.index("{"):])


def _get(result: dict, path: str):
    value = result
    for key in path.split("."):
        value = value[int(key)] if isinstance(value, list) else value[key]
    return value


def _missing(result: dict, path: str) -> str | None:
    """Why `path` names no value in `result` (the key that is not there and the keys that
    are), or None where it does."""
    value = result
    for key in path.split("."):
        if isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        elif isinstance(value, dict) and key in value:
            value = value[key]
        else:
            there = sorted(value) if isinstance(value, dict) else f"a {type(value).__name__}"
            return f"--figure {path}: no {key!r} in the script's output there (it has {there})"
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the earlier git revision")
    p.add_argument("--figure", action="append", default=[],
                   help="a dotted path to a number in the script's JSON (repeatable)")
    p.add_argument("--rounds", type=int, default=2, help="alternations of before and after")
    p.add_argument("script", nargs="+", help="the benchmark script and its arguments")
    args = p.parse_args()
    rev = subprocess.run(["git", "rev-parse", args.before], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    here = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            for _ in range(args.rounds):
                runs["before"].append(_run(tree, args.script))
                # A mistyped figure is said after the first run, not after every run.
                wrong = [w for w in (_missing(runs["before"][0], f) for f in args.figure) if w]
                if wrong:
                    sys.exit("; ".join(wrong) + ".")
                runs["after"].append(_run(ROOT, args.script))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           check=False, capture_output=True)
    figures = {}
    for path in args.figure:
        before = statistics.median(_get(r, path) for r in runs["before"])
        after = statistics.median(_get(r, path) for r in runs["after"])
        figures[path] = {"before": before, "after": after,
                         "after_over_before": round(after / before, 3) if before else None}
    print(json.dumps({"benchmark": "before_after", "script": args.script,
                      "before": rev, "after": f"{here} + working tree",
                      "machine": runs["after"][0].get("machine"), "figures": figures,
                      "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
