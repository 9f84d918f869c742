"""The `servescope` command line: the app, model management, generation and benchmarks."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from engine.config import ModelError


def main(argv: list[str] | None = None) -> int:
    """Entry point: no sub-command opens the desktop app."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        from app.main_window import run_app

        return run_app(argv)
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except (ModelError, ValueError, OSError) as exc:
        return _fail(args, exc)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _fail(args, exc: BaseException) -> int:
    message = str(exc)
    print(f"servescope: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"error": message}))
    return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="servescope", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    _models_parser(sub)
    _generate_parser(sub)
    _bench_parser(sub)
    _serve_parser(sub)
    from monitor.cli import add_monitor_parsers
    from planner.cli import add_plan_parser

    add_plan_parser(sub, more=_run_here_parser)
    add_monitor_parsers(sub)
    return p


# ---- plan run-here, and vLLM in plan machine ----
def _run_here_parser(plan_sub, common_arguments, layout_arguments) -> None:
    from app.plan_run import ENGINES

    machine = plan_sub.choices["machine"]
    machine.add_argument("--vllm", action="store_true",
                         help="also time real vLLM's own steps here (its Python as for "
                              "run-here; a few minutes), so plans served by vLLM are timed "
                              "with them")
    machine.add_argument("--vllm-eager", action="store_true",
                         help="with --vllm: time vLLM as `--enforce-eager` serves (no "
                              "torch.compile warm-up), for runs made with that flag")
    machine.set_defaults(func=_machine)

    p = plan_sub.add_parser(
        "run-here", help="run one layout on this machine: predict it, start its server, drive "
                         "its workload while recording, store the run beside the prediction",
        description="Predict the layout as `plan evaluate` does, start the layout's server "
                    "on this machine's loopback (real vLLM with the exported `vllm serve` "
                    "flags where vLLM is installed, else `servescope serve` with the same "
                    "settings), send the workload (prompt lengths in tokens of the server's "
                    "tokenizer), record the server's /metrics into the database and store the "
                    "run with its deployment and the prediction (`servescope plan machine` "
                    "first adds this machine to the catalog).")
    common_arguments(p)
    layout_arguments(p, gpu_default="this machine")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="requests per second (Poisson)")
    load.add_argument("--concurrency", type=int)
    p.add_argument("--model-path", help="the model's GGUF file or folder (default: the demo "
                                        "model's GGUF for the demo model)")
    p.add_argument("--requests", type=int, default=20, help="requests to send")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="the server: vllm (its Python: $SERVESCOPE_VLLM_PYTHON, else "
                        ".venv-vllm, else `vllm` on PATH), servescope, or auto (vLLM where "
                        "installed and able to run the plan; default)")
    p.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                   help="one more flag for the server, after the plan's (repeat it; e.g. "
                        "--server-arg=--enforce-eager)")
    p.add_argument("--db", help="SQLAlchemy URL (default: SQLite in the user's data folder)")
    p.set_defaults(func=_run_here)


def _machine(args) -> int:
    """`plan machine`, with vLLM's step timings first where --vllm asks for them."""
    from planner.cli import run_machine

    if args.vllm:
        from app import vllm_local

        python = vllm_local.vllm_python()
        try:
            if python is None:
                raise vllm_local.VllmUnavailable(
                    "No vLLM is installed here: set SERVESCOPE_VLLM_PYTHON to the Python of an "
                    "environment with vLLM, or leave out --vllm.")
            folder, _ = vllm_local.demo_folder(python)
            if not args.json:
                print(f"timing vLLM's steps with {python} (a few minutes)", file=sys.stderr)
            timings = vllm_local.measure_steps(python, folder, eager=args.vllm_eager)
        except vllm_local.VllmUnavailable as exc:
            return _fail(args, exc)
        path = Path(tempfile.mkstemp(prefix="servescope-vllm-steps-", suffix=".json")[1])
        try:
            path.write_text(json.dumps(timings))
            args.engine_timings = [*args.engine_timings, str(path)]
            return run_machine(args)
        finally:
            path.unlink(missing_ok=True)
    return run_machine(args)


def _run_here(args) -> int:
    from types import SimpleNamespace

    from app.plan_run import (
        PlanRun,
        PlanRunError,
        demo_model_path,
        for_engine,
        predicted_figures,
        run_here,
        run_workload,
    )
    from planner.catalog import load_catalog
    from planner.cli import deployment_from
    from planner.evaluate import evaluate
    from planner.workload import Workload
    from storage.db import StorageError, display_url, open_database

    catalog = load_catalog()
    d = for_engine(deployment_from(args, catalog), args.engine)
    w = run_workload(Workload(args.input_len, args.output_len, rate=args.rate,
                              concurrency=args.concurrency), args.requests)
    ev = evaluate(d, w, args.replicas)
    predicted = predicted_figures(ev)
    try:
        model_path = args.model_path or demo_model_path(d.model)
        db = open_database(args.db)
    except (PlanRunError, StorageError) as exc:
        return _fail(args, exc)
    say = (lambda m: None) if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        out = run_here(PlanRun(SimpleNamespace(deployment=d, memory=ev.memory), w, model_path,
                               args.requests, predicted, args.engine, tuple(args.server_arg)),
                       db, progress=say)
    except (PlanRunError, StorageError, RuntimeError) as exc:
        return _fail(args, exc)
    finally:
        db.close()
    out["db"] = display_url(db.url)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'':14}{'predicted':>12}{'measured':>12}")
    for key in ("throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
        print(f"{key:14}{predicted[key]:12.1f}{out['measured'][key]:12.1f}")
    print(f"served by {out['engine']}: {shlex.join(out['command'])}")
    print(f"stored as run {out['run_id']} in {out['db']} (server metrics as source "
          f"{out['source']!r})")
    return 0


def _engine_args(p: argparse.ArgumentParser) -> None:
    from engine.engine_config import EngineConfig

    EngineConfig.add_cli_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


# ---- models ----
def _models_parser(sub) -> None:
    p = sub.add_parser("models", help="fetch the demo model, list and register local models")
    msub = p.add_subparsers(dest="action", required=True)
    f = msub.add_parser("fetch", help="download the demo model (SmolLM2-135M-Instruct Q4_1)")
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=_models_fetch)
    ls = msub.add_parser("list", help="models in the cache and registered paths")
    ls.add_argument("--path", action="append", default=[], help="also scan this file or folder")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_models_list)
    add = msub.add_parser("add", help="register a GGUF file or Hugging Face folder")
    add.add_argument("path")
    add.set_defaults(func=_models_add)
    rm = msub.add_parser("remove", help="forget a registered path (the files stay)")
    rm.add_argument("path")
    rm.set_defaults(func=_models_remove)


def _models_fetch(args) -> int:
    from engine.models import fetch_demo_model

    path = fetch_demo_model()
    print(json.dumps({"path": str(path)}) if args.json else path)
    return 0


def _models_list(args) -> int:
    from pathlib import Path

    from engine.models import list_models

    models = list_models([Path(p) for p in args.path])
    if args.json:
        print(json.dumps({"models": [_model_row(m) for m in models]}))
        return 0
    if not models:
        print("No local models: run `servescope models fetch` for the demo model.",
              file=sys.stderr)
    for m in models:
        size = f"{m.size_bytes / 2**20:,.0f} MiB"
        print(f"{m.name:32} {m.format:5} {m.architecture or '?':8} {m.quantization or '':8} "
              f"{size:>10}  {m.path}")
    return 0


def _model_row(m) -> dict:
    return {"name": m.name, "path": str(m.path), "format": m.format, "size_bytes": m.size_bytes,
            "architecture": m.architecture, "quantization": m.quantization}


def _models_add(args) -> int:
    from engine.models import add_model_path

    info = add_model_path(args.path)
    print(f"registered {info.name}: {info.path}")
    return 0


def _models_remove(args) -> int:
    from engine.models import remove_model_path

    removed = remove_model_path(args.path)
    print("removed" if removed else f"{args.path} was not registered")
    return 0


# ---- generate ----
def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="one-shot generation with the embedded engine")
    _engine_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.set_defaults(func=_generate)


def _load(args):
    from engine.engine_config import EngineConfig

    config = EngineConfig.from_cli(args)  # bad values fail before torch or the model loads
    from engine import LLM
    from engine.models import DEMO_MODEL, fetch_demo_model

    if config.model == DEMO_MODEL:
        fetch_demo_model()
    t = time.perf_counter()
    llm = LLM(config)
    print(f"loaded {llm.model_name} on {llm.device} ({llm.dtype}, {llm.weights} weights) in "
          f"{time.perf_counter() - t:.1f} s", file=sys.stderr)
    if llm.fallback_reason:
        print(f"note: {llm.fallback_reason}", file=sys.stderr)
    return llm


def _generate(args) -> int:
    from engine import SamplingParams

    llm = _load(args)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop))
    prompt = args.prompt
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompt = llm.chat_prompt([*messages, {"role": "user", "content": args.prompt}])
    out = llm.generate([prompt], params)[0]
    m = out.metrics
    if args.json:
        print(json.dumps({
            "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
            "ttft_ms": _ms(m.ttft_s), "tpot_ms": _ms(m.tpot_s),
            "tokens_per_s": m.generated_tokens / (m.finished - m.arrival),
            "prompt_tokens": m.prompt_tokens, "generated_tokens": m.generated_tokens,
            "model": llm.model_name, "device": str(llm.device), "dtype": llm.dtype,
            "speculative": None if llm.spec is None else llm.spec.summary(),
            **_kv_report(llm)}))
    else:
        print(out.text)
        print(f"[{m.generated_tokens} tokens, TTFT {_ms(m.ttft_s):.0f} ms, "
              f"TPOT {_ms(m.tpot_s) or 0:.1f} ms, {out.finish_reason}]", file=sys.stderr)
    return 0


def _kv_report(llm) -> dict:
    """The KV options in force and what they did: pool size, tokens evicted, prefix-cache hit
    rate."""
    return {"kv_cache_dtype": llm.kv_cache_dtype, "kv_cache_bytes": llm.kv_cache_bytes,
            "kv_policy": llm.kv_policy or "none", "kv_budget": llm.kv_budget,
            "kv_tokens_evicted": llm.evictor.tokens_evicted,
            "prefix_caching": llm.prefix_cache is not None,
            "prefix_cache_hit_rate": None if llm.prefix_cache is None
            else llm.prefix_cache.counters.hit_rate}


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


# ---- bench ----
def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="engine benchmark: prefill, TTFT, decode, throughput")
    _engine_args(p)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    p.add_argument("--no-save", action="store_true", help="do not keep the result")
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    from engine.bench import run_benchmark, save_result

    llm = _load(args)
    result = run_benchmark(llm, quick=args.quick,
                           progress=lambda e: print(f"[{e.fraction:4.0%}] {e.message}",
                                                    file=sys.stderr))
    result["speculative"] = None if llm.spec is None else llm.spec.summary()
    result.update(_kv_report(llm))
    if not args.no_save:
        save_result(result)
    if args.json:
        print(json.dumps(result))
    else:
        _print_bench(result)
    return 0


def _print_bench(r: dict) -> None:
    print(f"prefill ({r['prefill_tokens']} tokens): {r['prefill_tokens_per_s']:,.0f} tok/s, "
          f"TTFT {r['ttft_ms']:.0f} ms")
    print(f"batch-1 decode: {r['decode_tokens_per_s']:.1f} tok/s")
    for n, v in r["throughput_tokens_per_s"].items():
        print(f"throughput at {n:>3} concurrent: {v:,.1f} tok/s")


# ---- serve ----
def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server for the engine, with /metrics")
    _engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $SERVESCOPE_API_KEY)")
    p.add_argument("--allow-unauthenticated-remote", action="store_true",
                   help="serve a non-loopback --host without an API key (anyone who reaches "
                        "the port can use the engine)")
    p.add_argument("--max-connections", type=int, default=512,
                   help="open connections before new ones get 503 (default 512)")
    # Tool calling, spelled as vLLM's flags.
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template (a file, or the template itself) to use instead "
                        "of the model's, e.g. one that shows the model its tools")
    p.add_argument("--tool-call-parser", default=None, choices=("hermes", "llama3_json"),
                   help="how tool calls are read from replies for tool_choice 'auto' (default: "
                        "the chat template's own format, where servescope knows it)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="as vLLM's: fail at start unless tool_choice 'auto' can work (it is on "
                        "whenever a parser is known)")
    p.set_defaults(func=_serve)


def _serve(args) -> int:
    import os

    from engine.server import Server, ServerLimits, is_loopback
    from engine.tool_calls import ToolServing

    api_key = args.api_key or os.environ.get("SERVESCOPE_API_KEY") or None
    if not is_loopback(args.host) and api_key is None:
        if not args.allow_unauthenticated_remote:
            raise ValueError(f"--host {args.host} serves beyond this machine without an API key: "
                             "set --api-key (or $SERVESCOPE_API_KEY), or pass "
                             "--allow-unauthenticated-remote to serve anyone who reaches the "
                             "port.")
        print(f"servescope: WARNING: serving {args.host} without an API key: anyone who "
              "reaches the port can use the engine.", file=sys.stderr, flush=True)
    if args.max_connections < 1:
        raise ValueError("--max-connections must be at least 1.")
    template = _chat_template(args.chat_template)
    llm = _load(args)
    limits = ServerLimits(max_connections=args.max_connections)
    tools = ToolServing.for_template(template or llm.tokenizer.chat_template,
                                     args.tool_call_parser, override=template is not None,
                                     auto_tool_choice=args.enable_auto_tool_choice)
    try:
        server = Server(llm, args.host, args.port, api_key, limits, tools)
    except OSError as exc:
        raise OSError(f"Cannot listen on {args.host}:{args.port} ({exc.strerror}): pick another "
                      "--port or stop what uses it.") from None
    print(f"serving {llm.model_name} at {server.url}/v1 (metrics at {server.url}/metrics"
          f"{', API key required' if api_key else ''}); Ctrl+C stops", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        server.close()
    return 0


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template itself when it is one (as vLLM reads it)."""
    from pathlib import Path

    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value}: no such file (give a Jinja template file).")


if __name__ == "__main__":
    sys.exit(main())
