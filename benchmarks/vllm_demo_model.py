"""The demo model as a Hugging Face folder for real vLLM (which cannot serve the demo GGUF).

Run with the project's Python: it fetches the demo GGUF and, the first time only, converts it
with the vLLM environment's own transformers (app/vllm_local.py says how), caching the folder.
Prints one JSON object: the folder, whether it was made now, and the seconds it took.

    .venv/bin/python benchmarks/vllm_demo_model.py [--vllm-python .venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.vllm_local import demo_folder, vllm_python  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=None,
                        help="the vLLM environment's Python (default: $SERVESCOPE_VLLM_PYTHON, "
                             "else .venv-vllm/bin/python, else the Python of `vllm` on PATH)")
    args = parser.parse_args()
    python = args.vllm_python or vllm_python()
    if python is None:
        raise SystemExit("no vLLM environment: set SERVESCOPE_VLLM_PYTHON or create .venv-vllm")
    start = time.perf_counter()
    folder, made = demo_folder(python)
    print(json.dumps({"folder": str(folder), "made": made,
                      "seconds": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
