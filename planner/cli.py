"""`servescope plan evaluate|search`: argparse wiring and the JSON the command prints."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from planner.catalog import KV_PRECISIONS, PRECISIONS, Catalog, CatalogError, load_catalog
from planner.cost import CostOptions
from planner.evaluate import InfeasibleError, evaluate, evaluation_dict
from planner.export import NotServable, sglang_command, vllm_command
from planner.hf_import import model_from_hf_config
from planner.search import SearchSpace, search
from planner.timing import Deployment, SpecDecode
from planner.validation import basis
from planner.workload import Slo, Workload

USER_ERRORS = (CatalogError, KeyError, ValueError)


def add_plan_parser(subparsers: Any, more: Any = None) -> argparse.ArgumentParser:
    """Add `plan` with its `evaluate`, `search` and `machine` sub-commands to an argparse
    subparsers; `more(sub, common_arguments, layout_arguments)` adds the app's own
    (`run-here`, which starts servers: the planner itself stays a pure model)."""
    plan = subparsers.add_parser("plan", help="size a deployment against a workload and SLOs")
    sub = plan.add_subparsers(dest="plan_command", required=True)
    ev = sub.add_parser("evaluate", help="predict latency, throughput and cost of one layout")
    common_arguments(ev)
    layout_arguments(ev)
    load = ev.add_mutually_exclusive_group(required=True)
    load.add_argument("--offline", action="store_true")
    load.add_argument("--rate", type=float, help="requests per second (Poisson)")
    load.add_argument("--concurrency", type=int)
    ev.set_defaults(func=run_evaluate)
    se = sub.add_parser("search", help="rank layouts meeting p99 SLOs at a request rate")
    common_arguments(se)
    se.add_argument("--rate", type=float, required=True, help="requests per second (Poisson)")
    se.add_argument("--ttft-p99-ms", type=float, required=True)
    se.add_argument("--tpot-p99-ms", type=float, required=True)
    se.add_argument("--gpus", nargs="+", default=[])
    se.add_argument("--budget-per-hour", type=float)
    se.add_argument("--spot-share", type=float, default=0.0)
    se.add_argument("--top", type=int, default=10, help="plans to print")
    se.add_argument("--spot-market", metavar="PROVIDER",
                    help="size a spot / on-demand pool of the best plan through simulated "
                         "interruptions, with that provider's reclaim rate (catalogs/spot.toml)")
    se.add_argument("--disaggregated", action="store_true",
                    help="also search separate prefill and decode pools and rank the best "
                         "against the best aggregated plan")
    se.add_argument("--spec-acceptance-from", metavar="SOURCE",
                    help="plan speculative decoding with the acceptance by draft position a "
                         "monitored server measured (`servescope record --server SOURCE=URL` "
                         "stored it), instead of the assumed 70%% a token")
    se.add_argument("--db", help="SQLAlchemy URL of the monitor's database (default: SQLite in "
                                 "the user's data folder)")
    se.set_defaults(func=run_search)
    ma = sub.add_parser("machine", help="measure this machine (bandwidth, matmul, engine step) "
                                        "and add it to the catalog as 'this machine'")
    ma.add_argument("--quick", action="store_true", help="fewer, smaller measurements")
    ma.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ma.add_argument("--engine-timings", metavar="FILE", action="append", default=[],
                    help="another engine's step timings (JSON) to fit beside servescope's")
    ma.set_defaults(func=run_machine)
    if more is not None:
        more(sub, common_arguments, layout_arguments)
    return plan


def layout_arguments(p: argparse.ArgumentParser, gpu_default: str | None = None) -> None:
    """One replica's layout: the flags of `plan evaluate` (and of `plan run-here`)."""
    p.add_argument("--gpu", required=gpu_default is None, default=gpu_default)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dcp", type=int, default=1,
                   help="decode context parallel size: TP ranks striping each KV cache")
    p.add_argument("--cp", type=int, default=1,
                   help="prefill context parallel size: TP x PP copies splitting each prompt")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--weights", choices=PRECISIONS, default="bf16")
    p.add_argument("--kv", choices=KV_PRECISIONS, default="bf16")
    p.add_argument("--max-seqs", type=int, default=256)


def deployment_from(args: argparse.Namespace, catalog: Catalog) -> Deployment:
    return Deployment(_model(catalog, args.model), catalog.gpu(args.gpu), args.weights, args.kv,
                      args.tp, args.pp, args.max_seqs, dcp=args.dcp, cp=args.cp)


def run_machine(args: argparse.Namespace) -> int:
    """engine/device_profile.py in its own interpreter: the planner itself runs without torch."""
    import subprocess

    from planner.catalog import config_dir

    command = [sys.executable, "-m", "engine.device_profile", "--write", str(config_dir())]
    command += ["--quick"] if args.quick else []
    for path in args.engine_timings:
        command += ["--engine-timings", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"servescope: measuring this machine failed ({last}): check that the engine "
              "runs here (`servescope bench --quick`).", file=sys.stderr)
        return 1
    profile = json.loads(done.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(profile))
        return 0
    entry = profile["entry"]
    print(f"{entry['name']}: read {profile['read_bandwidth_gbs']} GB/s, bf16 matmul "
          f"{profile['matmul_tflops']['bf16']} TFLOP/s, engine step overhead "
          f"{entry['step_overhead_ms']} ms; written to {profile['written']} "
          f"(plan on it with --gpu 'this machine')")
    if profile.get("replaced"):
        print(f"  the profile it replaced is kept as {profile['replaced']}")
    for name, fitted in profile["engines"].items():
        print(f"  {name}: bf16 matmul {fitted['tflops_bf16']} TFLOP/s, {fitted['overhead_ms']} "
              f"ms a step, {fitted['per_seq_ms']} ms a sequence (prefill fitted within "
              f"{fitted['prefill_fit_error_pct']}%)")
    return 0


def common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="catalog name or a Hugging Face config.json")
    p.add_argument("--input-len", type=int, required=True)
    p.add_argument("--output-len", type=int, required=True)
    p.add_argument("--num-requests", type=int, default=600)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _model(catalog: Catalog, name: str):
    path = Path(name)
    if path.suffix == ".json" or path.is_dir():
        return model_from_hf_config(path / "config.json" if path.is_dir() else path)
    return catalog.model(name)


def run_evaluate(args: argparse.Namespace) -> int:
    def work() -> dict:
        catalog = load_catalog()
        d = deployment_from(args, catalog)
        w = Workload(args.input_len, args.output_len, rate=args.rate,
                     concurrency=args.concurrency, offline=args.offline,
                     num_requests=args.num_requests)
        return evaluation_dict(evaluate(d, w, args.replicas))
    return _run(args, work, _print_evaluation)


def run_search(args: argparse.Namespace) -> int:
    def work() -> dict:
        catalog = load_catalog()
        model = _model(catalog, args.model)
        w = Workload(args.input_len, args.output_len, rate=args.rate,
                     num_requests=args.num_requests,
                     slo=Slo(args.ttft_p99_ms, args.tpot_p99_ms))
        space = SearchSpace(gpus=tuple(catalog.gpu(g).name for g in args.gpus))
        if args.spec_acceptance_from:
            space = replace(space, spec=(None, measured_spec(args.spec_acceptance_from,
                                                             args.db)))
        result = search(model, w, catalog, space, args.budget_per_hour,
                        cost_opts=CostOptions(spot_share=args.spot_share),
                        progress=lambda f, msg: print(f"[plan] {msg}", file=sys.stderr))
        if not result.candidates:
            raise InfeasibleError(result.infeasible)
        best = result.candidates[0]

        def with_commands(p) -> dict:  # each plan runs on its own, not only the best
            return {**p.as_dict(), "vllm_command": _or_none(vllm_command, p),
                    "sglang_command": _or_none(sglang_command, p)}

        out = {"model": model.name, "candidates": [with_commands(p) for p in
                                                   result.candidates[:args.top]],
                "pareto": [with_commands(p) for p in result.pareto],
                "notes": result.notes, "why_layout": result.why_layout or None,
                "evaluated": result.evaluated,
                "basis": basis(best.calibration, best.simulated),
                "fitting": result.fitting, "screened": result.screened,
                "simulated": result.simulated, "folded": result.folded,
                "seconds": round(result.seconds, 3),
                "vllm_command": _or_none(vllm_command, best),
                "sglang_command": _or_none(sglang_command, best)}
        if args.disaggregated:
            out["comparison"] = _comparison(model, w, catalog, space, args)
        if args.spot_market:
            out["spot"] = _spot(best, w, args.spot_market)
        return out
    return _run(args, work, _print_search)


def measured_spec(source: str, db_url: str | None) -> SpecDecode:
    """Speculation with the acceptance by draft position `source` stored in the monitor's
    database; ValueError (one sentence) where it stored none."""
    import sqlalchemy as sa

    from storage.db import StorageError, describe_error, open_database
    from storage.queries import acceptance_by_position, sources_with_acceptance

    try:
        db = open_database(db_url)
    except StorageError as exc:
        raise ValueError(str(exc)) from None
    try:
        rates = acceptance_by_position(db, source)
        known = [] if rates else sources_with_acceptance(db)
    except sa.exc.SQLAlchemyError as exc:
        raise ValueError(describe_error(exc, db.engine.url)) from None
    finally:
        db.close()
    if not rates:
        raise ValueError(f"{source!r} stored no speculative acceptance by draft position "
                         f"(sources that did: {', '.join(known) or 'none'}); record it while "
                         f"it speculates with `servescope record --server {source}=URL`")
    return SpecDecode.from_measured(rates, measured_on=source)


def _spot(best, w: Workload, provider: str) -> dict:
    from planner.spot import load_spot_markets, plan_spot

    markets = load_spot_markets()
    d = best.deployment
    market = markets.get((d.gpu.name, provider.lower()))
    if market is None:
        known = ", ".join(f"{g} at {p}" for g, p in sorted(markets)) or "none"
        raise ValueError(f"no spot interruption rate for {d.gpu.name} at {provider!r} in "
                         f"catalogs/spot.toml (known: {known}); add one to your config dir's "
                         f"catalogs/spot.toml")
    one, on_demand = plan_spot(d, w, best.replicas, market)
    together, _ = plan_spot(d, w, best.replicas, market, correlated=True)
    return {"one_reclaimed": one.as_dict(), "all_spot_reclaimed_at_once": together.as_dict(),
            "on_demand": on_demand.as_dict()}


def _or_none(render, plan) -> str | None:
    """A server's command for the plan, or None where that server cannot run it (the search
    offers only plans some server runs: vLLM, or SGLang for prefill context parallelism)."""
    try:
        return render(plan)
    except NotServable:
        return None


def _comparison(model, w: Workload, catalog: Catalog, space: SearchSpace,
                args: argparse.Namespace) -> dict:
    from planner.disagg import compare
    from planner.export import disagg_vllm_commands

    c = compare(model, w, catalog, space, cost_opts=CostOptions(spot_share=args.spot_share))
    out = c.as_dict()
    if c.disaggregated is not None:
        out["disaggregated"]["vllm_commands"] = disagg_vllm_commands(c.disaggregated)
    return out


def _run(args: argparse.Namespace, work: Any, show: Any) -> int:
    """Run `work`; a user error becomes one sentence on stderr and exit code 2."""
    try:
        result = work()
    except USER_ERRORS as exc:
        message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
        print(f"servescope plan: {message}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": message}))
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        show(result)
    return 0


def _print_band(basis_: dict) -> None:
    for key in ("throughput_tok_s", "ttft_p99_ms", "tpot_p99_ms"):
        band = basis_[key]["error_band"]
        if band:
            print(f"  {key}: median error {band['median_abs_error_pct']:.1f}% (largest "
                  f"{band['max_abs_error_pct']:.0f}%) over {band['against']}")


def _print_evaluation(r: dict) -> None:
    print(f"{r['model']} on {r['gpus_per_replica']}x {r['gpu']} ({r['layout']}) "
          f"x{r['replicas']} replicas ({r['weights']} weights, {r['kv']} KV)")
    print(f"  throughput  {r['throughput_tok_s']:.0f} output tok/s")
    for key in ("ttft_ms", "tpot_ms"):
        s = r[key]
        print(f"  {key[:-3].upper():5} mean {s['mean']:.1f}  p50 {s['p50']:.1f}  "
              f"p99 {s['p99']:.1f} ms")
    print(f"  cost        ${r['cost_per_hour']:.2f}/hour, ${r['cost_per_1m_tokens']:.3f} per 1M "
          f"output tokens (all cost); split by GPU time: "
          f"${r['cost_per_1m_input_tokens']:.3f} per 1M input, "
          f"${r['cost_per_1m_output_tokens']:.3f} per 1M output")
    print(f"  rests on    {r['basis']['throughput_tok_s']['rests_on']}")
    _print_band(r["basis"])


def _print_search(r: dict) -> None:
    print(f"{r['evaluated']} candidates in {r['seconds']:.2f} s; best plans for {r['model']}:")
    for i, p in enumerate(r["candidates"], 1):
        print(f"{i:3}. {p['replicas']}x {p['gpus'] // p['replicas']}x {p['gpu']} "
              f"{p['weights']}/{p['kv']} {p['layout']} seqs {p['max_seqs']}: "
              f"${p['cost_per_hour']:.2f}/h, TTFT p99 {p['ttft_p99_ms']:.0f} ms, "
              f"TPOT p99 {p['tpot_p99_ms']:.1f} ms")
    if r.get("why_layout"):
        print(f"why: {r['why_layout']}")
    print(f"deploy: {r['vllm_command'] or r['sglang_command']}")
    print(f"rests on: {r['basis']['throughput_tok_s']['rests_on']}")
    _print_band(r["basis"])
    spot = r.get("spot")
    if spot:
        for key in ("on_demand", "one_reclaimed", "all_spot_reclaimed_at_once"):
            p = spot[key]
            print(f"  {key.replace('_', ' ')}: {p['spot_replicas']} spot + "
                  f"{p['on_demand_replicas']} on demand, ${p['cost_per_hour']:.2f}/h, "
                  f"${p['cost_per_1m_input_tokens']:.3f}/1M in, "
                  f"${p['cost_per_1m_output_tokens']:.3f}/1M out, SLO attainment "
                  f"{p['slo_attainment']['long_run']:.4%}")
    c = r.get("comparison")
    if c:
        print(f"aggregated or disaggregated: {c['winner']} ({c['reason']})")
        for role, cmd in (c["disaggregated"] or {}).get("vllm_commands", {}).items():
            print(f"  {role}: {cmd}")
