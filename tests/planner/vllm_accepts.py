"""Run inside vLLM's environment: does vLLM accept each `vllm serve` command line?

Reads JSON on stdin: {"commands": [argv, ...], "folders": {model id: local folder}}. Each argv
(starting "vllm", "serve") goes through vLLM's own `vllm serve` argument parser
(make_arg_parser on a FlexibleArgumentParser, then validate_parsed_serve_args), and then,
with every model id swapped for a local folder holding that model's config.json (there is no
model hub here, and no weights are needed), through AsyncEngineArgs.from_cli_args and
create_engine_config: vLLM's config classes (ModelConfig with the checkpoint's quantization,
ParallelConfig, CacheConfig, SpeculativeConfig). Prints one JSON object: a result per command.
A command whose config only a CUDA machine resolves is reported as stage "cuda_only", apart
from rejections: prefill context parallelism runs in vLLM's V2 model runner, which vLLM picks
where Triton is installed (vllm/config/vllm.py, use_v2_model_runner); on this CPU it falls back
to the V1 runner, which refuses PCP.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

CUDA_ONLY = "Model Runner V1 does not support: prefill context parallel"


def check(argv: list[str], folders: dict[str, str], parser_factory, validate, engine_args):
    if argv[:2] != ["vllm", "serve"]:
        return "parse", f"not a `vllm serve` command: {argv[:2]}"
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            args = parser_factory().parse_args(argv[2:])
        validate(args)
    except SystemExit:
        return "parse", err.getvalue().strip()[-500:]
    except Exception as exc:
        return "parse", f"{type(exc).__name__}: {exc}"[:500]
    model = args.model_tag or args.model
    if model not in folders:
        return "config", f"no config.json for {model}"
    args.model, args.model_tag = folders[model], None
    args.served_model_name = [model]
    args.skip_tokenizer_init = True
    spec = args.speculative_config
    if isinstance(spec, dict) and spec.get("model"):
        if spec["model"] not in folders:
            return "config", f"no config.json for the draft {spec['model']}"
        spec["model"] = folders[spec["model"]]
    try:
        engine_args.from_cli_args(args).create_engine_config()
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}"[:800]
        return ("cuda_only" if CUDA_ONLY in message else "config"), message
    return None, ""


def main() -> None:
    request = json.load(sys.stdin)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def parser():
        return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))

    results = []
    for argv in request["commands"]:
        stage, error = check(argv, request["folders"], parser, validate_parsed_serve_args,
                             AsyncEngineArgs)
        results.append({"ok": stage is None, "stage": stage, "error": error})
    import vllm

    print(json.dumps({"vllm": vllm.__version__, "results": results}))


if __name__ == "__main__":
    main()
