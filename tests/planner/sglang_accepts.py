"""Run inside SGLang's environment: does SGLang accept each `sglang.launch_server` command?

Reads JSON on stdin: {"commands": [argv, ...], "folders": {model id: local folder}}. Each argv
(starting "python", "-m", "sglang.launch_server") goes through SGLang's own server-argument
parser (prepare_server_args: its argparse definitions, choices included), then, with every
model id swapped for a local folder holding that model's config.json (no hub here, no weights
needed), through ServerArgs.resolve_once and check_server_args: the resolution pipeline that
reads the model's config and applies SGLang's rules (parallelism, speculative decoding,
KV-cache dtype, quantization against the checkpoint).

There is no GPU here, and SGLang's resolution refuses to run without an accelerator, so each
command is resolved with `--device cpu` added: rules that hold on every device are checked,
while those SGLang applies only to CUDA (kernel backends, memory fractions) are not. One rule
cannot pass here: SGLang registers GPTQ checkpoints' method only through its CUDA Marlin
kernels (it reads "gptq" as gptq_marlin there; its CPU engine needs sgl-kernel, a CUDA 12
build that does not load here), so a GPTQ checkpoint's resolution ends "Unknown quantization
method: gptq"; it is reported as stage "cuda_only", apart from rejections. Prints one JSON
object: a result per command.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

PREFIX = ["python", "-m", "sglang.launch_server"]
# What SGLang's model config says of a GPTQ checkpoint off CUDA (see the docstring).
CUDA_ONLY = "Unknown quantization method: gptq."
# The flags whose value is a model id, swapped for its local folder.
MODEL_FLAGS = ("--model-path", "--speculative-draft-model-path")


def local(argv: list[str], folders: dict[str, str]) -> tuple[list[str] | None, str]:
    """argv's arguments with model ids as folders (None, and why, for an unknown id)."""
    args = list(argv[len(PREFIX):])
    for i, flag in enumerate(args[:-1]):
        if flag in MODEL_FLAGS:
            if args[i + 1] not in folders:
                return None, f"no config.json for {args[i + 1]}"
            args[i + 1] = folders[args[i + 1]]
    return args + ["--device", "cpu", "--skip-tokenizer-init"], ""


def check(argv: list[str], folders: dict[str, str], prepare) -> tuple[str | None, str]:
    if argv[:len(PREFIX)] != PREFIX:
        return "parse", f"not an `sglang.launch_server` command: {argv[:3]}"
    args, why = local(argv, folders)
    if args is None:
        return "config", why
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            server_args = prepare(args)
    except SystemExit:
        return "parse", err.getvalue().strip()[-500:]
    except Exception as exc:
        return "parse", f"{type(exc).__name__}: {exc}"[:500]
    try:
        server_args.resolve_once()
        server_args.check_server_args()
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}"[:800]
        return ("cuda_only" if CUDA_ONLY in message else "config"), message
    return None, ""


def main() -> None:
    request = json.load(sys.stdin)
    import sglang
    from sglang.srt.server_args import prepare_server_args

    results = []
    for argv in request["commands"]:
        stage, error = check(argv, request["folders"], prepare_server_args)
        results.append({"ok": stage is None, "stage": stage, "error": error})
    print(json.dumps({"sglang": sglang.__version__, "results": results}))


if __name__ == "__main__":
    main()
