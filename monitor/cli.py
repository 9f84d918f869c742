"""`servescope record` and `servescope loadtest`: the monitor without a window."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading

from storage.db import StorageError


class UserError(Exception):
    """A mistake in the command line or its inputs; the message is one sentence."""


def _fail(args: argparse.Namespace, message: str) -> int:
    print(message, file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"error": message}))
    return 2


def _token(args: argparse.Namespace) -> str | None:
    name = getattr(args, "token_env", None)
    if not name:
        return None
    if name not in os.environ:
        raise UserError(f"the environment variable {name} (from --token-env) is not set")
    return os.environ[name]


def _server_configs(args: argparse.Namespace) -> list:
    from monitor.remote import ServerConfig

    configs = []
    for i, spec in enumerate(args.server or []):
        # NAME= ends at the first "=" (a URL's query may hold more: ssh://box/8000?gpus=off).
        name, _, url = spec.partition("=") if "=" in spec.split("://")[0] else ("", "", spec)
        try:
            configs.append(ServerConfig(name or f"server{i + 1}", url, token=_token(args),
                                        interval_s=args.interval, timeout_s=args.timeout))
        except ValueError as exc:
            raise UserError(f"--server {spec}: {exc}") from exc
    return configs


def cmd_record(args: argparse.Namespace) -> int:
    """Sample the chosen sources into the database until --duration or Ctrl+C."""
    from monitor.drift import drift_rules
    from monitor.nvml import NvmlSource
    from monitor.recording import Recording
    from monitor.ssh import server_source
    from storage.db import open_database

    try:
        if args.duration is not None and args.duration <= 0:
            raise UserError("--duration must be positive")
        if args.slo_window <= 0:
            raise UserError("--slo-window must be positive")
        if args.interval <= 0 or args.timeout <= 0:
            raise UserError("--interval and --timeout must be positive")
        canaries = _canaries(args)
        servers, others = _server_configs(args), _prom_api(args) + canaries
        if not (servers or others or args.gpus):
            raise UserError("nothing to record; give --gpus, --server URL, --prom-url URL "
                            "and/or --canary NAME=URL")
        db = open_database(args.db)
        # Sources made once the database is open: a server's drift baselines are read from it.
        sources = [server_source(c, _with_stored_baselines(db, c.name)) for c in servers] + others
        if args.gpus:
            sources.append(NvmlSource(interval_s=args.interval))
    except (UserError, StorageError) as exc:
        return _fail(args, str(exc))
    for s in sources:
        if s.status.message:
            print(f"{s.name}: {s.status.message}", file=sys.stderr)
    recording = Recording(sources, on_error=_say, on_recover=_say, on_flush=_flush_reporter(args),
                          on_status=_print_status_change, on_alert=lambda e: _say(e.message))
    recording.attach_database(db)
    servers = [s.name for s in sources if not isinstance(s, NvmlSource) and s not in canaries]
    recording.set_rules(_slo_rules(args, servers) + drift_rules(servers)
                        + _canary_rules(canaries))
    with _stop_on_signals() as stop:
        recording.start()
        stop.wait(args.duration)
        recording.stop()
    statuses = recording.hub.statuses() or {s.name: s.status for s in sources}
    summary = _record_summary(db.url, recording.writer, statuses, recording.events)
    recording.close()
    if args.json:
        print(json.dumps(summary))
    else:
        print(_record_report(summary), file=sys.stderr)
    return 0 if "error" not in summary else 1


@contextlib.contextmanager
def _stop_on_signals():
    """An event set by Ctrl+C (SIGINT) or SIGTERM (`kill`, `docker stop`, systemd), so either
    ends the run the same way: sampling stops and what is pending is written (a second signal
    stops at once). SIGTERM's default ended the process with the writer's queue unwritten.
    The handlers are installed whatever the parent left in place, and SIGUSR1 prints every
    thread's stack to stderr (a recorder that does not stop can then be asked where it waits).
    The previous handlers come back afterwards (`main` may run inside another program, a test
    runner among them); off the main thread, where Python allows no handlers, the event is set
    only by --duration."""
    import faulthandler
    import signal

    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handle(signum, frame) -> None:
        if stop.is_set():  # a second Ctrl+C while pending data is written: stop at once
            raise KeyboardInterrupt
        stop.set()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    dump = getattr(signal, "SIGUSR1", None)  # not on Windows
    if dump is not None:
        try:
            faulthandler.register(dump, all_threads=True)
        except (ValueError, OSError):  # io.UnsupportedOperation: a stderr with no file behind
            dump = None
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if dump is not None:
            faulthandler.unregister(dump)


def _with_stored_baselines(db, name: str):
    """A server source's maker whose drift is judged against the baselines an earlier run
    stored for `name` in `db` (as the Monitor pane does), learning them only when there are none.
    A database that cannot be read here is said, and the baselines are learnt again."""
    import sqlalchemy as sa

    from monitor.drift import OutputDrift, load_baselines
    from monitor.remote import PrometheusSource

    try:
        baselines = load_baselines(db, name)
    except sa.exc.SQLAlchemyError as exc:
        print(f"{name}: the stored drift baselines cannot be read ({type(exc).__name__}); "
              "learning them again from the first requests", file=sys.stderr)
        baselines = {}
    return lambda config: PrometheusSource(config, drift=OutputDrift(baselines=baselines))


_print_lock = threading.Lock()


def _say(line: str) -> None:
    """One whole line on stderr. Sources, the writer and alerts report from their own threads;
    print() writes the text and its newline separately, so lines would interleave (a CI run read
    'flushed 1796288122.26v' where a source's line came in between)."""
    with _print_lock:
        sys.stderr.write(f"{line}\n")
        sys.stderr.flush()


def _print_status_change(name: str, status) -> None:
    """Live on stderr, from the source's own thread: a source came up, went down and why."""
    if status.state == "up":
        line = f"{name} is up: {status.message}"
    else:
        line = f"{name} is {status.state}: {status.last_error or status.message or 'no reason'}"
    _say(line)


def _record_summary(db_url: str, writer, statuses: dict, alerts: list) -> dict:
    """The run in numbers; "error" is set, with one sentence, when the run lost data."""
    summary = {
        "db": db_url, "samples": writer.written_samples, "dropped": writer.dropped,
        "submitted": writer.submitted_samples,
        "requests": writer.written_requests, "alerts": [[e.rule, e.state] for e in alerts],
        "sources": {n: s.state for n, s in statuses.items()},
        "reasons": {n: s.last_error or s.message or None for n, s in statuses.items()
                    if s.state != "up"},
        "scrapes": {n: {"ok": s.scrapes - s.failed_scrapes, "failed": s.failed_scrapes,
                        "non_finite": s.non_finite_total} for n, s in statuses.items()},
    }
    error = _record_error(writer, statuses)
    if error:
        summary["error"] = error
    return summary


def _record_error(writer, statuses: dict) -> str | None:
    """One sentence when nothing was stored or something was lost, else None."""
    if writer.written_samples + writer.written_requests == 0:
        if writer.dropped and writer.last_error:
            return f"Nothing was recorded: {writer.last_error}"
        down = [f"{n}: {s.last_error or s.message or s.state}" for n, s in statuses.items()
                if s.state != "up"]
        if down and len(down) == len(statuses):
            every = ("every source was down" if all(s.state == "down" for s in statuses.values())
                     else "no source was up")  # e.g. --gpus on a machine without a driver
            return f"Nothing was recorded: {every} ({'; '.join(down)})."
        return ("Nothing was recorded: the sources answered but sent no series servescope "
                "reads" + (f" ({'; '.join(down)})." if down else "."))
    if writer.dropped or writer.dropped_requests:
        why = f": {writer.last_error}" if writer.last_error else ""
        return (f"{writer.dropped} samples and {writer.dropped_requests} requests could not be "
                f"stored{why.rstrip('.')}.")
    return None


def _record_report(summary: dict) -> str:
    """The human summary: one line per source (with why it is down), then what was stored."""
    lines = []
    for name, state in summary["sources"].items():
        counts = summary["scrapes"][name]
        tried = counts["ok"] + counts["failed"]
        line = f"  {name}: {state}"
        if tried:
            line += f", {counts['ok']} of {tried} scrapes ok"
        if counts["non_finite"]:
            line += f", {counts['non_finite']} NaN/±Inf values skipped"
        if summary["reasons"].get(name):
            line += f": {summary['reasons'][name]}"
        lines.append(line)
    dropped = f", {summary['dropped']} dropped" if summary["dropped"] else ""
    lines.append(f"recorded {summary['samples']} samples into {summary['db']}{dropped}")
    if "error" in summary:
        lines.append(summary["error"])
    return "\n".join(lines)


def _prom_api(args: argparse.Namespace) -> list:
    from monitor.promapi import PromApiSource
    from monitor.remote import ServerConfig

    if not args.prom_url:
        return []
    try:
        return [PromApiSource(ServerConfig("prometheus", args.prom_url, token=_token(args),
                                           interval_s=args.interval,
                                           timeout_s=args.timeout))]
    except ValueError as exc:
        raise UserError(f"--prom-url {args.prom_url}: {exc}") from exc


def _canaries(args: argparse.Namespace) -> list:
    """The quality canaries asked for: each scores the held-out text on its server."""
    from monitor.canary import parse_canary

    try:
        return [parse_canary(spec, _token(args)) for spec in args.canary or []]
    except ValueError as exc:
        raise UserError(str(exc)) from exc


def _canary_rules(canaries: list) -> list:
    """A drift alert per canary, judged over its own interval."""
    from monitor.canary import canary_rule

    return [canary_rule(c.name, interval_s=c.interval_s) for c in canaries]


def _slo_rules(args: argparse.Namespace, names: list[str]) -> list:
    """p99 SLO rules per server; the recording stores their fire / clear events as they come."""
    from monitor.alerts import slo_rules

    return slo_rules(names, {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}, args.slo_window)


def _flush_reporter(args: argparse.Namespace):
    if not getattr(args, "report_flushes", False):
        return None
    return lambda ts: _say(f"flushed {ts!r}")


def _read_lengths(path: str) -> list[tuple[int, int]]:
    try:
        with open(path) as f:
            rows = [line.replace(",", " ").split() for line in f if line.strip()]
        pairs = [(int(a), int(b)) for a, b in rows]
    except (OSError, ValueError) as exc:
        raise UserError(f"--lengths-file {path}: expected lines 'input output' ({exc})") from exc
    if not pairs:
        raise UserError(f"--lengths-file {path} holds no lengths")
    return pairs


def _load_spec(args: argparse.Namespace):
    from monitor.loadgen import LoadSpec

    slo = {k: v for k, v in (("ttft", args.slo_ttft_ms), ("tpot", args.slo_tpot_ms),
                             ("e2e", args.slo_e2e_ms)) if v is not None}
    lengths = _read_lengths(args.lengths_file) if args.lengths_file else None
    try:
        return LoadSpec(url=args.url, endpoint=args.endpoint, model=args.model, rate=args.rate,
                        arrival=args.arrival, burstiness=args.burstiness,
                        concurrency=args.concurrency, requests=args.requests,
                        warmups=args.warmups, duration_s=args.duration, input_len=args.input_len,
                        input_unit=args.input_unit, output_len=args.output_len,
                        length_spread=args.length_spread,
                        lengths=lengths, token=_token(args), seed=args.seed, slo_ms=slo,
                        server_estimates=not args.no_server_metrics)
    except ValueError as exc:
        raise UserError(str(exc)) from exc


def _server_info(args: argparse.Namespace):
    from monitor.loadgen import ServerInfo

    try:
        return ServerInfo(gpu=args.gpu, tp=args.tp, pp=args.pp, weights=args.weights,
                          kv=args.kv, engine=args.engine)
    except ValueError as exc:
        raise UserError(str(exc)) from exc


def cmd_loadtest(args: argparse.Namespace) -> int:
    """Load an endpoint, print the figures, and store the run (in --db, else the default
    database the app's History pane reads) unless --no-db."""
    from monitor.loadgen import LoadError, run_load, store_run
    from storage.db import display_url, open_database

    try:
        spec, server = _load_spec(args), _server_info(args)
        # A named database is opened first, so a wrong URL fails before the load; the default
        # one only once there is a run to store.
        db = open_database(args.db) if args.db and not args.no_db else None
    except (UserError, StorageError) as exc:
        return _fail(args, str(exc))

    def progress(done: int, total: int) -> None:
        print(f"\r{done}/{total}", end="", file=sys.stderr)

    try:
        result = run_load(spec, progress=None if args.json else progress)
    except LoadError as exc:
        return _fail(args, str(exc))
    summary = dict(result.summary)
    if result.summary["completed"] == 0:
        return _fail(args, f"no request to {spec.url} succeeded: "
                           f"{(summary.get('errors') or ['no answer'])[0]}")
    if not args.no_db:
        try:
            db = db or open_database()
            summary["run_id"] = store_run(db, result, server=server)
            summary["db"] = display_url(db.url)
        except (StorageError, RuntimeError) as exc:
            return _fail(args, str(exc))
        finally:
            if db is not None:
                db.close()
    print(json.dumps(summary) if args.json else _table(summary))
    return 0


def _table(s: dict) -> str:
    lines = [f"{'':8}{'p50':>10}{'p95':>10}{'p99':>10}{'mean':>10}"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        row = [s[key][k] for k in ("p50", "p95", "p99", "mean")]
        lines.append(f"{key:8}" + "".join("       n/a" if v is None else f"{v:10.2f}"
                                          for v in row))
    lines.append(f"completed {s['completed']}, failed {s['failed']}, "
                 f"{s['request_throughput']:.2f} req/s, {s['output_tokens_per_s']:.1f} tok/s"
                 + ("" if s["goodput"] is None else f", goodput {s['goodput']:.2f} req/s"))
    lines += _server_lines(s.get("server"))
    if "run_id" in s:
        lines.append(f"stored as run {s['run_id']} in {s['db']}")
    return "\n".join(lines)


def _server_lines(server: dict | None) -> list[str]:
    """The server's own estimates over the run's requests, each with its bucket."""
    if not server:
        return []
    if "unavailable" in server:
        return [f"no server estimates: {server['unavailable']}"]
    lines = [f"the server's own histograms ({server['url']}, {server['requests']} requests "
             f"counted{'' if server['settled'] else ', not all yet'}):"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        for p, got in (server.get(key) or {}).items():
            hi = "+Inf" if got["hi"] is None else f"{got['hi']:g}"
            lines.append(f"  {key[:-3]} {p} {got['estimate']:.2f} ms, between "
                         f"{got['lo']:g} and {hi} ms")
    return lines


def _diagnosis_window(args: argparse.Namespace, db) -> tuple[float, float]:
    """The window to judge: --window seconds up to --end (default: the last sample), or the
    whole recording; a database without samples is one sentence."""
    from storage.queries import samples_span

    span = samples_span(db, args.source)
    if span is None:
        which = f" of source {args.source!r}" if args.source else ""
        raise UserError(f"The database {db.url} holds no samples{which} to diagnose; record "
                        "some first (servescope record --db ... --server URL).")
    end = span[1] if args.end is None else args.end
    start = span[0] if args.window is None else end - args.window
    if end <= start:
        raise UserError(f"The database {db.url} holds samples of one instant only "
                        f"({end:.3f}); a diagnosis needs a span of time.")
    return start, end


def _diagnosis_text(result, stored: list[int]) -> str:
    lines = []
    for v in result.verdicts:
        where = v.source + (f" GPU {v.gpu}" if v.gpu else "")
        lines.append(f"{where}: {v.title}")
        lines += [f"    evidence: {e.sentence()}" for e in v.evidence]
        lines.append(f"    try: {v.advice}")
    if not result.verdicts:
        lines.append(result.summary())
    if stored:
        lines.append(f"stored {len(stored)} verdict(s)")
    return "\n".join(lines)


def cmd_diagnose(args: argparse.Namespace) -> int:
    """Judge the stored series with monitor.diagnosis' rules; store and print the verdicts."""
    from monitor.diagnosis import StoredSeries, evaluate, verdicts_csv
    from storage.db import open_database
    from storage.queries import list_verdicts, save_verdicts

    try:
        if args.window is not None and args.window <= 0:
            raise UserError("--window must be positive")
        _database_must_exist(args.db)
        db = open_database(args.db)
    except (UserError, StorageError) as exc:
        return _fail(args, str(exc))
    try:
        if args.history:
            rows = list_verdicts(db, args.source)
            print(json.dumps({"db": db.url, "verdicts": rows}) if args.json else
                  "\n".join(f"{r['source']}: {r['title']}" for r in rows) or "no verdicts stored")
            return 0
        start, end = _diagnosis_window(args, db)
        result = evaluate(StoredSeries(db, args.source), start, end)
        verdicts = [v.to_dict() for v in result.verdicts]
        stored = [] if args.no_store else save_verdicts(db, verdicts)
        if args.csv:
            with open(args.csv, "w", encoding="utf-8", newline="") as f:
                f.write(verdicts_csv(verdicts))
    except UserError as exc:
        return _fail(args, str(exc))
    except OSError as exc:
        return _fail(args, f"Could not write {args.csv}: {exc.strerror or exc}.")
    finally:
        db.close()
    if args.json:
        print(json.dumps({"db": db.url, "start": start, "end": end, "series": result.series,
                          "verdicts": verdicts, "not_evaluated": result.not_evaluated,
                          "summary": result.summary(), "stored": stored}))
    else:
        print(_diagnosis_text(result, stored))
    return 0


def _database_must_exist(url: str | None) -> None:
    """A SQLite file that is not there is a mistake here (opening would create it empty)."""
    from sqlalchemy.engine import make_url

    from storage.db import default_url

    parsed = make_url(url or default_url())
    local = parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:")
    if local and not os.path.exists(parsed.database):
        raise UserError(f"There is no database at {parsed.database}; give the --db a "
                            "recording wrote (servescope record --db ...).")


def _add_diagnose_parser(subparsers) -> None:
    d = subparsers.add_parser(
        "diagnose", help="name the bottleneck or cause in stored series",
        description="Judge the stored series with the diagnosis rules (memory- or compute-bound "
                    "GPUs, KV-cache pressure, a long request holding the batch, throttling, ECC, "
                    "throughput drops, queue growth, cost per token): each verdict with its "
                    "evidence and what to try, stored in the database. Exit status: 0 when "
                    "judged (with or without verdicts), 2 for a mistake or a database without "
                    "samples.")
    d.add_argument("--db", help="SQLAlchemy URL (default: SQLite in the user's data folder)")
    d.add_argument("--source", help="judge only this source's series")
    d.add_argument("--window", type=float, help="seconds to judge, ending at --end "
                                                 "(default: the whole recording)")
    d.add_argument("--end", type=float, help="unix time the window ends (default: last sample)")
    d.add_argument("--no-store", action="store_true", help="print only; store no verdict")
    d.add_argument("--history", action="store_true", help="list the stored verdicts instead")
    d.add_argument("--csv", metavar="FILE", help="also write the verdicts as CSV")
    d.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    d.set_defaults(func=cmd_diagnose)


def add_monitor_parsers(subparsers) -> None:
    """Add `record` and `loadtest` to servescope's sub-command parsers."""
    rec = subparsers.add_parser(
        "record", help="sample GPUs and servers into the database",
        description="Sample GPUs and servers into the database. Each source is scraped on its "
                    "own schedule; a source going down or coming back is said on stderr with "
                    "the reason. Exit status: 0 when everything sampled was stored, 1 when "
                    "nothing was stored or samples were lost (one sentence says why), 2 for a "
                    "mistake in the command line.")
    rec.add_argument("--db", help="SQLAlchemy URL (default: SQLite in the user's data folder)")
    rec.add_argument("--gpus", action="store_true", help="sample local NVIDIA GPUs")
    rec.add_argument("--server", action="append", metavar="[NAME=]URL",
                     help="a server's base or /metrics URL, or ssh://[user@]host[:port]/PORT "
                          "for PORT on that box's loopback through SSH (your ~/.ssh/config, "
                          "known_hosts and agent; its GPUs by nvidia-smi unless ?gpus=off); "
                          "repeat for several")
    rec.add_argument("--prom-url", help="a Prometheus server to query (fleet-wide vLLM series)")
    rec.add_argument("--canary", action="append", metavar="NAME=URL[,every=S]",
                     help="score the bundled held-out text's perplexity on this server every S "
                          "seconds (default 300) and alert on drift from its baseline")
    rec.add_argument("--token-env", help="environment variable holding a bearer token")
    rec.add_argument("--slo-ttft-ms", type=float, help="alert when a server's p99 TTFT is above")
    rec.add_argument("--slo-tpot-ms", type=float, help="alert when a server's p99 TPOT is above")
    rec.add_argument("--slo-window", type=float, default=5.0,
                     help="seconds of a server's p99 the SLO alerts judge")
    rec.add_argument("--duration", type=float, help="seconds to record (default: until Ctrl+C)")
    rec.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    rec.add_argument("--timeout", type=float, default=5.0,
                     help="seconds a server's whole scrape may take, body included (default 5)")
    rec.add_argument("--json", action="store_true", help="print one JSON summary at the end")
    rec.add_argument("--report-flushes", action="store_true", help=argparse.SUPPRESS)
    rec.set_defaults(func=cmd_record)

    lt = subparsers.add_parser("loadtest", help="load an OpenAI-compatible endpoint")
    lt.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    lt.add_argument("--rate", type=float, help="requests per second (open loop)")
    lt.add_argument("--concurrency", type=int,
                    help="requests in flight: alone a closed loop; with --rate a cap that "
                         "arrivals wait for (as vllm bench serve's --max-concurrency)")
    lt.add_argument("--arrival", choices=("poisson", "gamma", "constant"), default="poisson")
    lt.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; <1 is burstier")
    lt.add_argument("--requests", type=int, default=100)
    lt.add_argument("--warmups", type=int, default=0,
                    help="requests sent one at a time first and not recorded (as vllm bench "
                         "serve's initial test prompt): a fresh server's first is slower")
    lt.add_argument("--duration", type=float, help="stop sending after this many seconds")
    lt.add_argument("--input-len", type=int, default=128,
                    help="prompt length, in --input-unit (default words)")
    lt.add_argument("--input-unit", choices=("words", "tokens"), default="words",
                    help="tokens: prompts of exactly --input-len tokens of the server's own "
                         "tokenizer (its /tokenize), sent as token ids (completions only)")
    lt.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    lt.add_argument("--length-spread", type=float, default=0.0,
                    help="uniform lengths within +- this fraction (0 = fixed)")
    lt.add_argument("--lengths-file", help="file of 'input output' lengths, one pair a line")
    lt.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    lt.add_argument("--model", help="model name to put in each request")
    lt.add_argument("--token-env", help="environment variable holding a bearer token")
    lt.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT SLO in ms")
    lt.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT SLO in ms")
    lt.add_argument("--slo-e2e-ms", type=float, help="goodput: end-to-end SLO in ms")
    lt.add_argument("--seed", type=int, default=0)
    lt.add_argument("--no-server-metrics", action="store_true",
                    help="do not read the server's /metrics before and after the run (by "
                         "default its own latency estimates over the run's requests are "
                         "stored beside the exact ones)")
    store = lt.add_mutually_exclusive_group()
    store.add_argument("--db", help="store the run in this database (SQLAlchemy URL; default: "
                                    "SQLite in the user's data folder, which the app shows)")
    store.add_argument("--no-db", action="store_true", help="store nothing; only print")
    server = lt.add_argument_group("the server measured (stored with the run; the planner "
                                   "calibrates from runs that name their GPU)")
    server.add_argument("--gpu", help="its GPU, e.g. 'H100 SXM' or 'NVIDIA L4'")
    server.add_argument("--tp", type=int, default=1, help="its tensor-parallel size")
    server.add_argument("--pp", type=int, default=1, help="its pipeline-parallel size")
    server.add_argument("--weights", help="its weight precision: bf16, fp16, fp8, int8, int4")
    server.add_argument("--kv", help="its KV-cache precision (default: the weights')")
    server.add_argument("--engine", help="its engine and version, e.g. 'vLLM 0.8.5'")
    lt.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    lt.set_defaults(func=cmd_loadtest)
    _add_diagnose_parser(subparsers)


def main(argv: list[str] | None = None) -> int:
    """Run `record` or `loadtest` on their own (python -m monitor.cli ...)."""
    parser = argparse.ArgumentParser(prog="servescope")
    add_monitor_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
