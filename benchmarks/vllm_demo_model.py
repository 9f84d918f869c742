"""The demo model as a Hugging Face folder for real vLLM (which cannot serve the demo GGUF).

Run with the project's Python: it fetches the demo GGUF (engine.models.fetch_demo_model), and the
first time only, runs the vLLM virtual environment's Python on this same file with `--convert`:
transformers loads the GGUF (`gguf_file=`, dequantized to float32), its state dict is copied into
a plain `LlamaForCausalLM` of the same config (the GGUF-loaded model refuses `save_pretrained`),
and that is saved in bfloat16 with its tokenizer. The folder is cached under the user cache dir
(`SERVESCOPE_VLLM_MODEL_DIR` overrides), keyed by the GGUF's SHA-256, and written atomically.
Prints one JSON object: the folder, whether it was made now, and the seconds it took.

    .venv/bin/python benchmarks/vllm_demo_model.py [--vllm-python .venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPLETE = ".servescope-complete"


def default_vllm_python() -> str | None:
    """The vLLM environment's Python: `SERVESCOPE_VLLM_PYTHON`, else `.venv-vllm/bin/python`."""
    explicit = os.environ.get("SERVESCOPE_VLLM_PYTHON")
    if explicit:
        return explicit
    local = ROOT / ".venv-vllm" / "bin" / "python"
    return str(local) if local.exists() else None


def folder_for(sha256: str) -> Path:
    """Where the converted demo model lives (one folder per GGUF content)."""
    override = os.environ.get("SERVESCOPE_VLLM_MODEL_DIR")
    if override:
        return Path(override)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("servescope")) / "vllm-models" / f"smollm2-135m-{sha256[:12]}"


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE).exists() and (folder / "config.json").exists()


def ensure_folder(vllm_python: str, timeout_s: float = 900.0) -> tuple[Path, bool]:
    """The converted folder, converting it with `vllm_python` the first time; (folder, made)."""
    from engine.models import DEMO_SHA256, fetch_demo_model

    gguf = fetch_demo_model(progress=lambda message, fraction: None)
    folder = folder_for(DEMO_SHA256)
    if is_complete(folder):
        return folder, False
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".convert-"))
    try:
        done = subprocess.run([vllm_python, __file__, "--convert", str(gguf), str(tmp)],
                              capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"converting {gguf} with {vllm_python} failed:\n"
                               f"{done.stderr[-3000:]}")
        (tmp / COMPLETE).write_text(DEMO_SHA256 + "\n")
        if folder.exists():  # an incomplete earlier attempt
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder, True


def convert(gguf: Path, out: Path) -> None:
    """Load the GGUF with transformers and save a plain bfloat16 LlamaForCausalLM folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  torch_dtype=torch.float32)
    # The GGUF's quantization_config must not travel: vLLM would read the folder as GGUF.
    fields = {k: v for k, v in loaded.config.to_dict().items()
              if k not in ("quantization_config", "_name_or_path", "_model_name_or_path")}
    plain = LlamaForCausalLM(LlamaConfig.from_dict(fields))
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head may be absent from one side; anything else missing is a broken copy.
    bad = [k for k in [*missing, *unexpected] if k != "lm_head.weight"]
    if bad:
        raise SystemExit(f"state dict mismatch: {bad[:5]}")
    plain.to(torch.bfloat16)
    plain.config.torch_dtype = torch.bfloat16
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=None,
                        help="the vLLM environment's Python (default: $SERVESCOPE_VLLM_PYTHON, "
                             "else .venv-vllm/bin/python)")
    parser.add_argument("--convert", nargs=2, metavar=("GGUF", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.convert:
        convert(Path(args.convert[0]), Path(args.convert[1]))
        return
    vllm_python = args.vllm_python or default_vllm_python()
    if vllm_python is None:
        raise SystemExit("no vLLM environment: set SERVESCOPE_VLLM_PYTHON or create .venv-vllm")
    sys.path.insert(0, str(ROOT))
    start = time.perf_counter()
    folder, made = ensure_folder(vllm_python)
    print(json.dumps({"folder": str(folder), "made": made,
                      "seconds": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
