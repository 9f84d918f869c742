"""The stakeholder report as HTML (no Qt): recommendation, alternatives, charts, sources, deploy."""

from __future__ import annotations

import html
import json
import re
import shlex
import time
from pathlib import Path
from string import Template

from app.panes.planner.state import Outcome, plan_costs, plan_label
from app.plan_run import ValidationRow, validation_table
from planner.cost import CostOptions
from planner.export import (
    command_or_reason,
    kubernetes_yaml,
    sglang_command,
    shell_join,
    vllm_command,
)
from planner.memory import MEMORY_UTILIZATION, RUNTIME_RESERVE_GB
from planner.search import Plan

TEMPLATE = Path(__file__).with_name("report_template.html")
CHART_TITLES = {"pareto": "Cost against p99 latency", "ttft": "Simulated TTFT distribution",
                "tpot": "Simulated TPOT distribution", "day_cost": "Cost over a day",
                "memory": "Memory per GPU"}
ALTERNATIVES = 5


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _plan_row(plan: Plan) -> list[str]:
    return [plan_label(plan), str(plan.deployment.gpus * plan.replicas),
            f"{plan.cost_per_hour:.2f}", f"{plan.cost_per_1m_tokens:.3f}",
            f"{plan.ttft_p99_ms:.0f}", f"{plan.tpot_p99_ms:.1f}"]


PLAN_HEADER = ["Plan", "GPUs", "$/hour, day average", "$ per 1M tokens", "p99 TTFT ms",
               "p99 TPOT ms"]


def _summary(o: Outcome, best: Plan) -> str:
    f = o.form
    rows = [
        ["Model", f"{o.model.name} ({o.model.params_b:.1f} B parameters)"],
        ["Layout per replica", f"{best.deployment.gpus}x {best.deployment.gpu.name}, "
                               f"{best.deployment.layout}, "
                               f"{best.deployment.weights} weights, {best.deployment.kv} KV"],
        *([["Why this layout", o.result.why_layout]] if o.result.why_layout else []),
        ["Replicas at peak", str(best.replicas)],
        ["Cost", f"{plan_costs(best, f).text()}, "
                 f"${best.cost_per_1m_tokens:.3f} per 1M output tokens"],
        ["p99 TTFT", f"{best.ttft_p99_ms:.0f} ms (target {f.ttft_p99_ms:g} ms)"],
        ["p99 TPOT", f"{best.tpot_p99_ms:.1f} ms (target {f.tpot_p99_ms:g} ms)"],
        ["Memory per GPU", f"{best.memory.total_gb:.1f} of {best.deployment.gpu.memory_gb:g} GB; "
                           f"KV cache holds {best.memory.kv_tokens:,} tokens"],
    ]
    return _table(["", ""], rows)


def _speculation(f) -> str:
    """Where the draft's acceptance comes from, as the plans used it."""
    if not f.speculative:
        return "Speculative decoding: not planned."
    spec = f.spec_decode()
    where = (f"as measured on {spec.measured_on} (acceptance by draft position "
             + ", ".join(f"{a:.0%}" for a in spec.accepted_at) + ")"
             if spec.accepted_at else f"assumed: {spec.acceptance:.0%} a draft token")
    return (f"Speculative decoding: {spec.draft_len} draft tokens, {spec.tokens_per_step:.2f} "
            f"tokens a step, {where}.")


def _assumptions(o: Outcome) -> str:
    f = o.form
    spot = CostOptions().interruption_overhead
    items = [
        f"Traffic: {f.rate:g} requests/s at peak, {f.arrival} arrivals, daily profile "
        f"'{f.profile}'; autoscaling {'on' if f.autoscale else 'off'}.",
        f"Lengths: input {f.input_len} tokens ({f.input_dist}), output {f.output_len} tokens "
        f"({f.output_dist}); prefix share {f.prefix_share:.0%}.",
        f"Targets: p99 TTFT {f.ttft_p99_ms:g} ms, p99 TPOT {f.tpot_p99_ms:g} ms; budget "
        + (f"${f.budget_per_hour:.2f}/hour." if f.budget else "none."),
        f"Spot share {f.spot_share:.0%} with {spot:.0%} of spot capacity lost to interruptions.",
        _speculation(f),
        f"Memory: {MEMORY_UTILIZATION:.0%} of each GPU usable, {RUNTIME_RESERVE_GB} GB runtime "
        "reserve per GPU (plus NCCL buffers when GPUs talk).",
        f"Latencies from a discrete-event simulation of {f.num_requests} requests per plan "
        f"(continuous batching, KV-capacity admission, preemption); calibration: "
        f"{o.best.calibration}.",
        f"Search: {o.result.evaluated} candidates, {o.result.fitting} fit in memory, "
        f"{o.result.screened} passed the analytic screen, {o.result.simulated} simulated, "
        f"{len(o.result.candidates)} met every constraint ({o.result.seconds:.1f} s)"
        + (f"; {o.result.folded} plans differing only in the batch limit were folded into "
           f"the best of their shape." if o.result.folded else "."),
    ]
    return "<ul>" + "".join(f"<li>{html.escape(i)}</li>" for i in items) + "</ul>"


def _sources(o: Outcome) -> str:
    gpus = {p.deployment.gpu.name: p.deployment.gpu for p in o.result.candidates}
    rows = [[f"model {o.model.name}", o.model.source, o.model.date or "—"]]
    for gpu in gpus.values():
        rows.append([f"GPU {gpu.name} specs", gpu.source, gpu.date])
        rows.append([f"GPU {gpu.name} price ${gpu.on_demand:.2f}/h"
                     + (f", spot ${gpu.spot:.2f}/h" if gpu.spot else ""),
                     gpu.price_source, gpu.price_date])
    files = "".join(f"<li>{html.escape(f)}</li>" for f in o.catalog.files)
    return _table(["Figure", "Source", "Date"], rows) + f"<p>Catalog files:</p><ul>{files}</ul>"


# The plan's figures the trust table covers, in planner.validation.basis' keys.
TRUSTED = (("throughput_tok_s", "Throughput"), ("ttft_p99_ms", "p99 TTFT"),
           ("tpot_p99_ms", "p99 TPOT"), ("cost_per_1m_tokens", "$ per 1M tokens"),
           ("memory_gb_per_gpu", "Memory per GPU"))


def _band_text(entry: dict) -> str:
    band = entry.get("error_band")
    if not band:
        return entry.get("note") or "no validation set"
    return (f"median {band['median_abs_error_pct']:g}%, at most {band['max_abs_error_pct']:g}% "
            f"(median signed {band['median_signed_error_pct']:+g}%) over {band['against']}")


def trust_note(plan: Plan | None, runs: int) -> str:
    """One paragraph over the Validation tab's table: the chosen plan's error bands against
    published runs, and how many runs made here follow."""
    from planner.validation import basis

    here = (f"Below: {runs} plan run(s) made on this machine, each beside its prediction."
            if runs else "No plan has been run on this machine yet: Deploy → Run here adds one.")
    if plan is None:
        return "Search for a plan to see its error bands. " + here
    b = basis(plan.calibration, plan.simulated)
    bands = []
    for key, label in TRUSTED[:3]:
        band = b[key]["error_band"]
        if band:
            bands.append(f"{label} median {band['median_abs_error_pct']:g}% (at most "
                         f"{band['max_abs_error_pct']:g}%) over {band['points']} points")
    return (f"Against published runs, with calibration '{plan.calibration}': "
            + ("; ".join(bands) or "no published points") + ". " + here)


def _trust(best: Plan, runs: list[ValidationRow]) -> str:
    """What each figure rests on and its error against published runs, then every plan run on
    this machine beside its prediction, so the reader sees how far to trust a plan."""
    from planner.validation import basis

    b = basis(best.calibration, best.simulated)
    published = _table(["Figure", "Rests on", "Error against published runs"],
                       [[label, b[key]["rests_on"], _band_text(b[key])]
                        for key, label in TRUSTED])
    if not runs:
        here = ("<p>No plan has been run on this machine yet: Deploy → Run here serves the "
                "chosen plan, measures it and lists it here.</p>")
    else:
        here = _table(*validation_table(runs))
    return f"<h3>Against published runs</h3>{published}<h3>Against runs made here</h3>{here}"


def _flag_groups(words: list[str]) -> list[list[str]]:
    """Words grouped as the program and its positional arguments, then each --flag with its
    values."""
    groups: list[list[str]] = [[]]
    for word in words:
        if word.startswith("--") and groups[-1]:
            groups.append([])
        groups[-1].append(word)
    return groups


def command_lines(command: str, indent: str = "    ") -> str:
    """A one-line shell command as one flag (with its value) per line, joined by backslash
    continuations: still one runnable command, and no page or pane wraps inside a flag. A
    comment (an export a server cannot run, command_or_reason) passes through as it is."""
    if command.startswith("#"):
        return command
    return (" \\\n" + indent).join(shell_join(g) for g in _flag_groups(shlex.split(command)))


_FLOW_LIST = re.compile(r"^(\s*)([\w-]+): (\[.*\])$")


def manifest_lines(yaml_text: str, width: int = 72) -> str:
    """Kubernetes YAML with each long flow list (a container's args) split one flag per line;
    the same YAML to a parser, and nothing wraps inside a flag."""
    out = []
    for line in yaml_text.splitlines():
        match = _FLOW_LIST.match(line)
        try:
            items = json.loads(match.group(3)) if match and len(line) > width else None
        except ValueError:
            items = None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            out.append(line)
            continue
        lead = f"{match.group(1)}{match.group(2)}: ["
        rows = []
        for group in _flag_groups(items):
            row = ", ".join(json.dumps(w) for w in group)
            # A flag whose value is long (the speculative config) puts the value on its own row.
            fits = len(lead) + len(row) <= width
            rows += [row] if fits else [json.dumps(w) for w in group]
        out.append(lead + (",\n" + " " * len(lead)).join(rows) + "]")
    return "\n".join(out) + ("\n" if yaml_text.endswith("\n") else "")


def code_block(text: str) -> str:
    """Monospace lines that wrap only at spaces (Qt's PDF printing ignores <pre>'s pre-wrap and
    would run long lines off the page); leading spaces kept for YAML's indentation."""
    lines = []
    for line in text.splitlines():
        body = line.lstrip(" ")
        lines.append("&nbsp;" * (len(line) - len(body)) + html.escape(body))
    return ('<p style="font-family: monospace; font-size: 9pt; background-color: #f3f4f6;">'
            + "<br>".join(lines) + "</p>")


def _deploy(best: Plan) -> str:
    blocks = [("vLLM, one replica", command_lines(command_or_reason(vllm_command, best))),
              ("SGLang, one replica", command_lines(command_or_reason(sglang_command, best))),
              ("Kubernetes Deployment and HorizontalPodAutoscaler",
               manifest_lines(command_or_reason(kubernetes_yaml, best)))]
    return "".join(f"<h3>{html.escape(t)}</h3>{code_block(b)}" for t, b in blocks)


def report_html(o: Outcome, images: dict[str, str], image_width: int = 640,
                runs: list[ValidationRow] = ()) -> str:
    """The whole report; ``images`` maps chart keys to <img> sources (data URIs or names),
    drawn ``image_width`` pixels wide; ``runs``: the plan runs made on this machine."""
    best = o.best
    if best is None:
        raise ValueError("there is no recommended plan to report")
    charts = "".join(f"<h3>{html.escape(CHART_TITLES.get(k, k))}</h3>"
                     f'<p><img src="{html.escape(src)}" width="{image_width}"></p>'
                     for k, src in images.items())
    alternatives = [_plan_row(p) for p in o.result.candidates[1:1 + ALTERNATIVES]]
    return Template(TEMPLATE.read_text(encoding="utf-8")).substitute(
        title=html.escape(f"Serving plan: {o.model.name} at {o.form.rate:g} requests/s"),
        generated=time.strftime("%Y-%m-%d %H:%M"),
        recommendation=html.escape(f"{plan_label(best)}: {plan_costs(best, o.form).text()}, "
                                   f"p99 TTFT {best.ttft_p99_ms:.0f} ms, "
                                   f"p99 TPOT {best.tpot_p99_ms:.1f} ms"),
        summary=_summary(o, best),
        alternatives=_table(PLAN_HEADER, alternatives) if alternatives
        else "<p>No other plan met every constraint.</p>",
        charts=charts, trust=_trust(best, list(runs)), assumptions=_assumptions(o),
        sources=_sources(o), deploy=_deploy(best))
