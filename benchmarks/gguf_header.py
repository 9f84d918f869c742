"""Reading a GGUF file's metadata: gguf's own reader against servescope's (engine/loader/gguf.py
`_Reader`, the same parser over a plain ndarray view of the mapping instead of np.memmap).

Every model load and the Engine pane's memory estimate parse the whole metadata section first;
for the demo model that is about 147,000 fields and array items, most of them the tokenizer's
vocabulary and merges. Timed in alternation, fresh readers each round, and checked equal.

    python benchmarks/gguf_header.py [--model PATH] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import gguf  # noqa: E402

from engine.bench import machine  # noqa: E402
from engine.loader.gguf import open_gguf  # noqa: E402
from engine.models import fetch_demo_model  # noqa: E402


def _timed(make) -> tuple[float, object]:
    start = time.perf_counter()
    reader = make()
    return time.perf_counter() - start, reader


def _same(a, b) -> bool:
    return (list(a.fields) == list(b.fields)
            and all(a.fields[k].contents() == b.fields[k].contents() for k in a.fields)
            and all(x.name == y.name and (x.data == y.data).all()
                    for x, y in zip(a.tensors, b.tensors, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the demo model)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    path = Path(args.model) if args.model else fetch_demo_model()
    library, ours = [], []
    for _ in range(args.rounds):
        t_lib, lib = _timed(lambda: gguf.GGUFReader(path))
        t_ours, mine = _timed(lambda: open_gguf(path))
        library.append(t_lib)
        ours.append(t_ours)
    print(json.dumps({
        "benchmark": "gguf_header", "model": path.name, "machine": machine(),
        "rounds": args.rounds, "fields": len(lib.fields), "same_contents": _same(lib, mine),
        "gguf_reader_s_median": statistics.median(library),
        "servescope_reader_s_median": statistics.median(ours),
        "speedup": statistics.median(library) / statistics.median(ours),
    }))


if __name__ == "__main__":
    main()
