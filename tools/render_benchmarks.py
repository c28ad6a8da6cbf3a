#!/usr/bin/env python
"""The benchmarks page's tables and plots, drawn from the recorded runs in ``docs/benchmarks/``.

Each bench tool writes its run with ``--json docs/benchmarks/TOOL.json`` (the run added at the
file's end: date, commit, machine, command, arguments, the rows it printed); the test suite's times
are ``docs/benchmarks/suite.csv``, a run a line. Each question of ``docs/benchmarks.rst`` is a
table and a plot made here from those files. The docs' build draws them
(``docs/_ext/skyinfer_benchmarks.py``: ``.. skyinfer-benchmark:: NAME``, the plots into
``docs/_static/benchmarks/``, not committed); this command draws the same by hand::

    .venv/bin/python tools/render_benchmarks.py              # docs/_static/benchmarks/NAME.png and NAME.rst
    .venv/bin/python tools/render_benchmarks.py --out DIR    # elsewhere

Plots use matplotlib's Agg backend (no display).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "benchmarks"
OUT = ROOT / "docs" / "_static" / "benchmarks"


# -- the recorded runs ---------------------------------------------------------------------------------


def runs(tool: str) -> list[dict]:
    """The runs of ``tools/TOOL.py``, oldest first."""
    return json.loads((DATA / f"{tool}.json").read_text())


def suite() -> list[dict]:
    """The test suite's runs, oldest first (``#`` lines are comments)."""
    with open(DATA / "suite.csv", newline="") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def minutes(text: str) -> float | None:
    """``12m34s`` as minutes."""
    m = re.fullmatch(r"(\d+)m(\d+)s", text.strip())
    return int(m.group(1)) + int(m.group(2)) / 60 if m else None


def lo_hi(value) -> tuple[float, float]:
    """A figure (a number, or a range as [low, high]) as its low and high."""
    return (min(value), max(value)) if isinstance(value, list) else (value, value)


def mid(value) -> float:
    low, high = lo_hi(value)
    return (low + high) / 2


def fmt(value, spec: str = "", unit: str = "") -> str:
    """A figure as the page prints it: thousands with commas, a range as ``low-high``, none as a dash."""
    if value is None:
        return "--"
    if isinstance(value, list):
        return "-".join(fmt(v, spec) for v in value) + unit
    if isinstance(value, int) and not spec:
        return f"{value:,}{unit}"
    return f"{value:{spec or ','}}{unit}"


def label(run: dict) -> str:
    """A run as a plot's axis names it: its commit, else its date, else its place in the file."""
    return run.get("commit") or run.get("date") or "undated"


def row(run: dict, **match) -> dict:
    """The run's first row with these values (an empty one if none)."""
    return next((r for r in run["rows"] if all(r.get(k) == v for k, v in match.items())), {})


def latest(items: list[dict], keep: Callable[[dict], bool]) -> dict:
    return next(run for run in reversed(items) if keep(run))


def when(run: dict) -> str:
    bits = [b for b in (run.get("date"), run.get("commit")) if b]
    return ", ".join(bits) or "undated"


@attrs.frozen
class Table:
    caption: str
    header: list[str]
    rows: list[list[str]]


@attrs.frozen
class Question:
    table: Callable[[], Table]
    plot: Callable[[object], None] | None  # draws on a matplotlib Figure
    alt: str


# -- throughput beside vllm serve ----------------------------------------------------------------------

ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def _vllm_client(run: dict, concurrency: int) -> bool:
    args = run["arguments"]
    return bool(args.get("vllm_client")) and args.get("concurrency") == concurrency


def serving_table() -> Table:
    data = runs("bench_serving")
    at = {c: latest(data, lambda r, c=c: _vllm_client(r, c)) for c in (64, 256)}
    rows = []
    for route, name in ROUTES.items():
        cells = [name]
        for c in (64, 256):
            r = row(at[c], route=route, metric="tok_per_s")
            rounds = f" ({', '.join(fmt(x, '.2f') for x in r['rounds'])})" if r.get("rounds") else ""
            cells.append(fmt(r.get("ratio"), ".3f") + "x" + rounds)
        cpu = row(at[256], route=route, metric="cpu_s_per_1k_tokens")
        cells += [fmt(cpu.get("vllm"), ".3f"), fmt(cpu.get("skyinfer"), ".3f")]
        rows.append(cells)
    runs_of = when(at[64]) if when(at[64]) == when(at[256]) else f"{when(at[64])} (64) and {when(at[256])} (256)"
    caption = f"Output tokens/s, skyinfer / vllm serve (each round's); {runs_of}"
    header = ["route", "64 streams", "256 streams", "CPU-s / 1,000 tokens, vllm serve", "skyinfer"]
    return Table(caption, header, rows)


def serving_plot(fig) -> None:
    data = [r for r in runs("bench_serving") if r["arguments"].get("vllm_client")]
    # A place on the x axis per commit (or date), shared by its runs at 64 and 256 streams; a second
    # run at the same concurrency gets a place of its own.
    names: list[str] = []
    used: list[set[int]] = []
    at = []
    for r in data:
        c, name = r["arguments"]["concurrency"], label(r)
        x = next((i for i, n in enumerate(names) if n.rstrip("'") == name and c not in used[i]), None)
        if x is None:
            names.append(name + "'" * sum(n.rstrip("'") == name for n in names))
            used.append(set())
            x = len(names) - 1
        used[x].add(c)
        at.append(x)
    ax = fig.subplots()
    for c, marker in ((64, "o"), (256, "s")):
        for route, name in ROUTES.items():
            points = [
                (x, row(r, route=route, metric="tok_per_s")["ratio"])
                for x, r in zip(at, data)
                if r["arguments"]["concurrency"] == c and row(r, route=route, metric="tok_per_s")
            ]
            ax.plot(
                *zip(*points), marker=marker, linestyle="-" if name == "completions" else "--", label=f"{name}, {c}"
            )
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.text(0, 1.01, "vllm serve", color="grey", fontsize=8, va="bottom")
    ax.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
    ax.set_ylabel("tokens/s, skyinfer / vllm serve")
    ax.set_title("vLLM's benchmark client, each run (oldest first)", fontsize=9)
    ax.legend(fontsize=8, ncol=2)


# -- the front's cost beside vllm-router ---------------------------------------------------------------

FRONT_FIGURES = {
    "plain_cpu_per_request_us": "CPU per plain request",
    "stream_cpu_per_event_us": "per paced SSE event",
    "flood_cpu_per_event_us": "per flood event",
}


def _on_two_cores(run: dict) -> bool:
    return run["machine"].startswith("2")


def front_table() -> Table:
    run = latest(
        runs("bench_front"),
        lambda r: all(key in row(r, target="skyinfer") for key in FRONT_FIGURES) and row(r, target="vllm-router"),
    )
    targets = [t for t in ("skyinfer", "vllm-router", "aiohttp floor") if row(run, target=t)]
    rows = [[t] + [fmt(row(run, target=t).get(key), unit=" µs") for key in FRONT_FIGURES] for t in targets]
    sky, ref = row(run, target="skyinfer"), row(run, target="vllm-router")
    rows.append(["skyinfer / vllm-router"] + [f"{mid(sky[k]) / mid(ref[k]):.2f}x" for k in FRONT_FIGURES])
    caption = f"The middle process's CPU, medians: ``{run['command']}`` ({when(run)})"
    return Table(caption, ["", *FRONT_FIGURES.values()], rows)


def front_plot(fig) -> None:
    data = [r for r in runs("bench_front") if _on_two_cores(r)]
    plain, events = fig.subplots(1, 2)
    for ax, keys, title in (
        (plain, ["plain_cpu_per_request_us"], "CPU per plain request, µs"),
        (events, ["stream_cpu_per_event_us", "flood_cpu_per_event_us"], "CPU per SSE event, µs"),
    ):
        shown = [r for r in data if any(k in row(r, target="skyinfer") for k in keys)]
        names = [label(r) for r in shown]
        for target, color in (("skyinfer", "C0"), ("vllm-router", "C1"), ("aiohttp floor", "C2")):
            for key, style in zip(keys, ("-", "--")):
                points = [(i, row(r, target=target)[key]) for i, r in enumerate(shown) if key in row(r, target=target)]
                if not points:
                    continue
                x = [i for i, _ in points]
                y = [mid(v) for _, v in points]
                err = [[mid(v) - lo_hi(v)[0] for _, v in points], [lo_hi(v)[1] - mid(v) for _, v in points]]
                name = target + ("" if len(keys) == 1 else ", " + key.split("_")[0])
                ax.errorbar(x, y, yerr=err, marker="o", linestyle=style, color=color, label=name, capsize=2)
        ax.set_xticks(range(len(names)), names, rotation=40, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)


# -- a push beside the raw transport -------------------------------------------------------------------


def seconds(value: float | None) -> str:
    return "--" if value is None else f"{value:.3f} s" if value >= 0.01 else f"{value:.4f} s"


def _push_rows() -> list[tuple[str, str, float | None, float | None, float | None, str]]:
    """(transport, the raw transport, its seconds, skyinfer's seconds, the ratio where the run gave
    one, the run) per transport."""
    data = runs("bench_weight_sync")
    out = []
    for nodes in (1, 2):
        run = latest(
            data,
            lambda r, n=nodes: (
                r["arguments"].get("transport", "gloo") == "gloo"
                and r["arguments"].get("nodes", 1) == n
                and r["arguments"].get("model", "bench") == "bench"
                and row(r, step="raw")
            ),
        )
        name = f"gloo, {nodes} node{'s' * (nodes > 1)}, {run.get('mib', 352):.0f} MiB"
        raw, sky = row(run, step="raw")["seconds"], row(run, step="skyinfer")["seconds"]
        out.append((name, "a gloo broadcast", raw, sky, None, when(run)))
    loop = latest(data, lambda r: r["arguments"].get("model") == "demo" and bool(row(r, step="loop_push")))
    name = f"gloo, the RL loop's pause, push, resume, demo model ({loop.get('mib', 1):.0f} MiB)"
    alone, with_push = row(loop, step="loop_alone")["seconds"], row(loop, step="loop_push")["seconds"]
    out.append((name, "the loop's pause and resume alone", alone, with_push, None, when(loop)))
    shm = latest(data, lambda r: r["arguments"].get("transport") == "shm")
    for step, what in (("memcpy", "a memcpy into touched pages"), ("memcpy_fresh", "a memcpy into fresh pages")):
        name = f"shared memory (colocated), 2 engines, {shm.get('mib', 352):.0f} MiB"
        out.append((name, what, row(shm, step=step)["seconds"], row(shm, step="shm")["seconds"], None, when(shm)))
    wide = {"check": "ipc_push", "model": "wide, 1.418 GB"}
    ipc = latest(runs("gpu_check"), lambda r: bool(row(r, **wide)))
    copy = row(ipc, **wide, what="a device-to-device copy of the same bytes")
    push = row(ipc, **wide, what="IPCTrainer push from a separate process")
    name = "CUDA IPC (colocated), H100, 1.418 GB"
    out.append((name, "a device-to-device copy", copy["seconds"], push["seconds"], push.get("ratio"), when(ipc)))
    out.append(("NCCL (engines on GPUs of their own)", "not run on a GPU yet", None, None, None, ""))
    return out


def push_table() -> Table:
    rows = []
    for name, what, raw, sky, ratio, run in _push_rows():
        ratio = ratio or (sky / raw if raw else None)
        rows.append([name, f"{what}: {seconds(raw)}" if raw else what, seconds(sky), fmt(ratio, ".2g", "x"), run])
    caption = "A whole checkpoint's push beside the raw transport, medians of the rounds"
    return Table(caption, ["transport", "raw transport", "skyinfer's push", "push / raw", "run"], rows)


def push_plot(fig) -> None:
    measured = [r for r in _push_rows() if r[2] is not None]
    ax = fig.subplots()
    y = range(len(measured))
    ax.barh([i + 0.2 for i in y], [r[2] for r in measured], height=0.4, label="raw transport", color="C1")
    ax.barh([i - 0.2 for i in y], [r[3] for r in measured], height=0.4, label="skyinfer's push", color="C0")
    ax.set_title("NCCL: not run on a GPU yet", fontsize=8, loc="right")
    ax.set_yticks(list(y), [f"{name}\n({what})" for name, what, *_ in measured], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("seconds (log)")
    ax.legend(fontsize=8)


# -- a push's cost to the requests in flight -----------------------------------------------------------

STALL_MODES = {"pausing": "paused throughout", "staged": "staged, KV recomputed", "staged-keep": "staged, KV kept"}


def stall_table() -> Table:
    rows = []
    data = runs("bench_push_stall")
    for gb in (1.07, 0):
        run = latest(data, lambda r, gb=gb: r.get("model_gb") == gb and "stall_x_gap" in row(r, mode="pausing"))
        name = f"{gb} GB model" if gb else "demo model"
        for mode, what in (*STALL_MODES.items(), ("at rest", "the same push at rest")):
            r = row(run, mode=mode)
            if r:
                rows.append([
                    f"{name}: {what}", fmt(r.get("stall_p50_ms"), unit=" ms"), fmt(r.get("stall_x_gap"), ".1f", "x"),
                    fmt(r.get("push_ms"), unit=" ms"), fmt(r.get("push_x_pausing"), ".2f", "x"),
                ])  # fmt: skip
    caption = f"The longest gap between two events of a stream, p50 over 3 pushes ({when(run)})"
    return Table(caption, ["push", "longest stall", "x median gap", "push (call)", "x paused push"], rows)


def stall_plot(fig) -> None:
    shown = [r for r in runs("bench_push_stall") if any("stall_x_gap" in x for x in r["rows"])]
    ax = fig.subplots()
    width = 0.8 / len(shown)
    for k, run in enumerate(shown):
        size = f"{run['model_gb']} GB" if run.get("model_gb") else "demo"
        name = f"{size}, {run.get('date') or 'before the swap by pointer'}"
        points = [
            (i, row(run, mode=m)["stall_x_gap"]) for i, m in enumerate(STALL_MODES) if "stall_x_gap" in row(run, mode=m)
        ]
        ax.bar([i - 0.4 + width * (k + 0.5) for i, _ in points], [v for _, v in points], width=width, label=name)
    ax.set_xticks(range(len(STALL_MODES)), list(STALL_MODES.values()), fontsize=8)
    ax.set_ylabel("longest stall / median gap")
    ax.legend(fontsize=7)


# -- a crash's cost ------------------------------------------------------------------------------------


def spread(rows: list[dict], key: str):
    """A figure over rows (a tool's run has one per round; a recorded one may give a range): one
    value, or its range as [low, high]; None where no row has it."""
    values = [v for r in rows if r.get(key) is not None for v in (r[key] if isinstance(r[key], list) else [r[key]])]
    if not values:
        return None
    return values[0] if min(values) == max(values) else [min(values), max(values)]


def _crash_kind(run: dict) -> str:
    serve_args = " ".join(map(str, run["arguments"].get("serve_args", [])))
    if run.get("restart"):
        return run["restart"]
    if "--warm-spares 0" in serve_args:
        return "no spare"
    return "an importing spare" if "--loaded-spares off" in serve_args else "a loaded spare (the CPU default)"


def _crash_rows() -> list[tuple[str, object, object, str]]:
    """(what, seconds under load, seconds at rest, the run) per measured way of coming back, the
    newest run of each."""
    out = {}
    for run in reversed(runs("bench_crash")):
        kind = _crash_kind(run)
        if kind not in out:
            loaded = [r for r in run["rows"] if r.get("loaded")]
            rest = [r for r in run["rows"] if not r.get("loaded")]
            out[kind] = (
                f"EngineCore SIGKILLed, {kind}",
                spread(loaded, "serving_s"),
                spread(rest, "serving_s"),
                when(run),
            )
    rows = list(out.values())
    warm = latest(runs("bench_recovery"), lambda r: bool(row(r, kill="enginecore")))
    core = row(warm, kill="enginecore")
    rows.append(("EngineCore SIGKILLed, until /ready: an importing spare", None, core["warm_s"], when(warm)))
    rows.append(("EngineCore SIGKILLed, until /ready: no spare", None, core["cold_s"], when(warm)))
    templates = latest(runs("bench_templates"), lambda r: bool(row(r, engine_templates="auto")))
    for setting in ("auto", "off"):
        seconds = row(templates, engine_templates=setting)["restart_s"]
        rows.append((f"engine process SIGKILLed, no spare, templates {setting}", None, seconds, when(templates)))
    return rows


def crash_table() -> Table:
    def secs(value) -> str:  # tenths, as recorded (hundredths below 10 s where the run gave them)
        spec = ".2f" if value is not None and not isinstance(value, list) and round(value, 1) != value else ".1f"
        return fmt(value, spec, " s")

    rows = [[what, secs(load), secs(rest), run] for what, load, rest, run in _crash_rows()]
    now = latest(runs("bench_crash"), lambda r: _crash_kind(r).startswith("a loaded spare"))
    under = [r for r in now["rows"] if r.get("loaded")]
    caption = (
        f"Seconds from the kill until the engine serves again; under load with a loaded spare ({when(now)}): "
        f"{fmt(spread(under, 'whole'))} of 32 requests whole, {fmt(spread(under, 'errors'))} error events, "
        f"{fmt(spread(under, 'kept'))} tokens kept, the longest break {fmt(spread(under, 'longest_break_ms'))} ms"
    )
    return Table(caption, ["crash and restart", "under load", "at rest", "run"], rows)


def crash_plot(fig) -> None:
    shown = _crash_rows()
    ax = fig.subplots()
    for offset, index, name, color in ((0.2, 1, "under load", "C3"), (-0.2, 2, "at rest", "C0")):
        points = [(i, r[index]) for i, r in enumerate(shown) if r[index] is not None]
        mids = [mid(v) for _, v in points]
        err = [
            [m - lo_hi(v)[0] for m, (_, v) in zip(mids, points)],
            [lo_hi(v)[1] - m for m, (_, v) in zip(mids, points)],
        ]
        ax.barh([i + offset for i, _ in points], mids, height=0.4, xerr=err, capsize=2, label=name, color=color)
    ax.set_yticks(range(len(shown)), [r[0] for r in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("seconds after the kill (log)")
    ax.legend(fontsize=8)


# -- memory over a day of pushes -----------------------------------------------------------------------


def soak_table() -> Table:
    run = latest(runs("bench_soak"), lambda r: bool(r["rows"]))
    summary = run.get("summary", {})
    engines = sorted({r["engine"] for r in run["rows"]})
    pushes = sorted({r["push"] for r in run["rows"] if r["push"]})
    first, last = pushes[0], pushes[-1]
    rss = {(r["push"], r["engine"]): r["rss_mib"] for r in run["rows"]}
    rows = [
        [f"RSS after push {first}"] + [fmt(rss[first, e], unit=" MiB") for e in engines],
        [f"RSS after push {last}"] + [fmt(rss[last, e], unit=" MiB") for e in engines],
        [f"after push {last} / after push {first}"] + [f"{rss[last, e] / rss[first, e]:.3f}" for e in engines],
    ]
    gap = summary.get("last_weights_gap")
    gap = max(gap.values()) if isinstance(gap, dict) else gap
    other = summary.get("other_weights_gap")
    other = min(other.values()) if isinstance(other, dict) else other
    blank = [""] * (len(engines) - 1)
    rows += [
        ["requests whole / failed (both engines)", f"{summary['requests_whole']:,} / {summary['requests_failed']}", *blank],
        ["pushes returned, engines restarted",
         f"{summary['pushes_returned']} of {run['arguments'].get('pushes', 200)}, "
         f"{', '.join(summary['engines_restarted']) or 'none'}", *blank],
        ["last weights, max logprob gap", f"{gap} from transformers float32 ({other} from the other set)", *blank],
        ["push time p50: " + ", ".join(summary["push_s_p50"]), ", ".join(f"{v:.2f} s" for v in summary["push_s_p50"].values()), *blank],
    ]  # fmt: skip
    caption = f"``{run['command']}``, {run['arguments'].get('pushes', 200)} pushes ({when(run)})"
    return Table(caption, ["", *(f"engine {e}" for e in engines)], rows)


def soak_plot(fig) -> None:
    run = latest(runs("bench_soak"), lambda r: bool(r["rows"]))
    tolerance = run["arguments"].get("memory_tolerance", 0.10)
    pushes = sorted({r["push"] for r in run["rows"] if r["push"]})
    ax = fig.subplots()
    for engine in sorted({r["engine"] for r in run["rows"]}):
        points = sorted((r["push"], r["rss_mib"]) for r in run["rows"] if r["engine"] == engine and r["push"])
        base = dict(points)[pushes[0]]
        ax.plot([p for p, _ in points], [m / base for _, m in points], marker="o", label=f"engine {engine}")
        ax.annotate(f"{points[-1][1] / base:.3f}", points[-1], xytext=(4, 0), textcoords="offset points", fontsize=8)
    ax.axhspan(1 - tolerance, 1 + tolerance, color="grey", alpha=0.15, label=f"bench_soak.py's bound ({tolerance:.0%})")
    ax.set_xlim(0, pushes[-1] * 1.1)
    ax.set_xlabel("pushes")
    ax.set_ylabel(f"RSS / RSS after push {pushes[0]}")
    ax.set_title(f"each engine's process tree, resident, after its pushes ({when(run)})", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")


# -- the suite's time ----------------------------------------------------------------------------------


def suite_table() -> Table:
    rows = []
    for r in list(reversed(suite()))[:8]:
        note = f"note {r['note']}" if r["note"].isdigit() else r["note"]
        ci = r["ci_run"] + (f" (pytest {r['pytest']})" if r["pytest"] else "")
        rows.append([f"{r['commit']} ({r['tests'] or '--'})", r["date"] or r["where"], r["run_tests"] or "--", ci or "--",
                     r["result"] or "green", note])  # fmt: skip
    caption = "The newest runs (all of them: ``docs/benchmarks/suite.csv``; note N: the journal's)"
    return Table(caption, ["commit (tests)", "date", "tools/run-tests", ".ci/run", "result", "note"], rows)


def suite_plot(fig) -> None:
    data = suite()
    ax = fig.subplots()
    for key, name, color in (("ci_run", ".ci/run", "C0"), ("run_tests", "tools/run-tests", "C2")):
        points = [(i, minutes(r[key]), bool(r["result"])) for i, r in enumerate(data) if minutes(r[key])]
        style = "-" if key == "ci_run" else "none"  # tools/run-tests was timed now and then: points alone
        ax.plot(
            [i for i, _, _ in points], [m for _, m, _ in points], marker=".", linestyle=style, color=color, label=name
        )
        failed = [(i, m) for i, m, bad in points if bad]
        if failed:
            ax.plot(*zip(*failed), "x", color="C3", label=f"{name}, a test failed")
    ax.axhline(20, color="grey", linewidth=1, linestyle=":")
    ax.text(len(data) - 1, 20.3, "20 minutes", color="grey", fontsize=8, ha="right")
    ticks: list[tuple[int, str]] = []
    for i, r in enumerate(data):
        day = r["date"][5:10]
        if day and all(day != d for _, d in ticks) and (not ticks or i - ticks[-1][0] >= 6):
            ticks.append((i, day))
    ax.set_xticks([i for i, _ in ticks], [d for _, d in ticks], fontsize=8, rotation=30)
    ax.set_ylabel("minutes")
    ax.set_ylim(bottom=0)
    ax.set_title("each run on a clean clone, oldest first (ticks: a day's first run, month-day)", fontsize=9)
    ax.legend(fontsize=8)


# -- the other tools -----------------------------------------------------------------------------------


def _other(tool: str, keep: Callable[[dict], bool], say: Callable[[dict], str]) -> list[str]:
    run = latest(runs(tool), keep)
    return [f"``tools/{tool}.py``", say(run), when(run)]


def other_table() -> Table:
    def pause(r):
        p, q = row(r, call="pause"), row(r, call="resume")
        return (f"pause p50 {p['skyinfer_p50_ms']} ms against {p['vllm_p50_ms']} ms for two vllm serve (p90 "
                f"{p['skyinfer_p90_ms']} / {p['vllm_p90_ms']}); resume p50 {q['skyinfer_p50_ms']} / {q['vllm_p50_ms']} ms")  # fmt: skip

    def routing(r):
        s = {x["setup"]: x for x in r["rows"]}
        return ("tokens/s " + ", ".join(f"{n} {s[n]['tokens_per_s']}" for n in s)
                + "; prefix-cache hits " + ", ".join(f"{s[n]['hit_rate']:.1%}" for n in s))  # fmt: skip

    def lora(r):
        get = {x["what"]: x for x in r["rows"]}
        return (f"reload from a path {get['reload from a local path, skyinfer']['seconds']} s (vllm serve "
                f"{get['reload from a local path, vllm serve']['seconds']}), pushed "
                f"{get['push over the transfer group, skyinfer']['seconds']} s; tokens/s with the adapter "
                f"{get['serving, skyinfer']['adapter_tok_per_s']} against {get['serving, vllm serve']['adapter_tok_per_s']}")  # fmt: skip

    def engine_start(parallel):
        def say(r):
            sky, ref = row(r, server="skyinfer"), row(r, server="vllm serve")
            return (f"{'one engine of -dp 2' if parallel else 'one engine'}: ready {sky['ready_s']} s against "
                    f"{ref['ready_s']} s for vllm serve, {sky['cpu_s']} CPU-s against {ref['cpu_s']}")  # fmt: skip

        return say

    def spin(r):
        sky, ref = r["rows"][0], row(r, server="vllm serve")
        return (f"{sky['server']}: {sky['paced']} CPU-s per paced request against {ref['paced']} for vllm serve, "
                f"{sky['rps']} req/s back to back against {ref['rps']}")  # fmt: skip

    def templates(r):
        on, off = row(r, engine_templates="auto"), row(r, engine_templates="off")
        return (f"a restart without a spare {on['restart_s']} s against {off['restart_s']} s without templates; "
                f"a server's start {on['ready_cpu_s']} CPU-s against {off['ready_cpu_s']}")  # fmt: skip

    def held(r):
        return f"both engines SIGKILLed at rest: ready {r['rows'][0]['ready_s']} s, {r['rows'][0]['refused']} requests refused"

    rows = [
        _other("bench_pause", lambda r: bool(row(r, call="resume")), pause),
        _other("bench_router", lambda r: bool(r["rows"]),
               lambda r: f"throughput router / direct {r['ratio']} ({row(r, target='router')['tokens_per_s']:,} against "
               f"{row(r, target='direct')['tokens_per_s']:,} tokens/s)"),
        _other("bench_routing", lambda r: len(r["rows"]) == 3 and "p99" in r["rows"][0], routing),
        _other("bench_lora", lambda r: bool(row(r, what="the reset call")), lora),
        _other("bench_moe_push", lambda r: True,
               lambda r: f"MoE {row(r, model='moe')['seconds']} s against dense {row(r, model='dense')['seconds']} s, "
               f"{row(r, model='moe')['mib']} MiB each"),
        _other("bench_engine_start", lambda r: not r["arguments"].get("parallel"), engine_start(False)),
        _other("bench_engine_start", lambda r: bool(r["arguments"].get("parallel")), engine_start(True)),
        _other("bench_templates", lambda r: True, templates),
        _other("bench_worker_spin", lambda r: "rps" in row(r, server="vllm serve"), spin),
        _other("bench_recovery", lambda r: "refused" in (r["rows"] or [{}])[0], held),
        _other("bench_lease", lambda r: True,
               lambda r: ", ".join(f"{x['what']} {x['best_us']} µs" for x in r["rows"]) + " per request, in process"),
    ]  # fmt: skip
    return Table("", ["tool", "figures", "run"], rows)


QUESTIONS = {
    "serving": Question(serving_table, serving_plot, "skyinfer's output tokens/s over vllm serve's, by run"),
    "front": Question(front_table, front_plot, "CPU per request and per event of skyinfer and vllm-router, by run"),
    "push": Question(push_table, push_plot, "a push's seconds beside the raw transport's, by transport"),
    "stall": Question(
        stall_table, stall_plot, "the longest stall during a push over the median gap, by way of pushing"
    ),
    "crash": Question(crash_table, crash_plot, "seconds from an engine's kill until it serves again, by restart"),
    "soak": Question(soak_table, soak_plot, "each engine's resident memory over 200 pushes"),
    "suite": Question(suite_table, suite_plot, "the test suite's minutes, run after run"),
    "other": Question(other_table, None, ""),
}


# -- output --------------------------------------------------------------------------------------------


def table_rst(name: str) -> list[str]:
    """The question's table as an rst ``list-table``."""
    table = QUESTIONS[name].table()
    lines = [f".. list-table:: {table.caption}".rstrip(), "   :header-rows: 1", ""]
    for cells in [table.header, *table.rows]:
        cells = [_cell(cell) for cell in cells]
        lines.append(f"   * - {cells[0]}")
        lines += [f"     - {cell}" for cell in cells[1:]]
    return lines


def _cell(text: str) -> str:
    """A cell's text as rst reads it as text: one that would start a list (``(51)``, ``- x``, ``2. x``)
    begins with an escaped space."""
    text = " ".join(str(text).split())
    if re.match(r"(\(?\w{1,3}[.)](\s|$)|[-*+#](\s|$))", text):
        return "\\ " + text
    return text or " "


def inputs() -> list[Path]:
    """What a plot is drawn from: the data and this file."""
    return [Path(__file__), *DATA.iterdir()]


def draw(name: str, path: Path) -> None:
    """The question's plot as a PNG at ``path`` (written whole, then moved into place)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.6), dpi=100, layout="constrained")
    QUESTIONS[name].plot(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    fig.savefig(partial, format="png")
    os.replace(partial, path)


def render(out: Path = OUT, tables: bool = False, stale_only: bool = False) -> list[Path]:
    """Every question's plot into ``out`` (``stale_only``: those older than their inputs), and with
    ``tables`` its table as ``NAME.rst``; the files written."""
    newest = max(p.stat().st_mtime for p in inputs())
    written = []
    for name, question in QUESTIONS.items():
        if question.plot is not None:
            path = out / f"{name}.png"
            if not stale_only or not path.exists() or path.stat().st_mtime < newest:
                draw(name, path)
                written.append(path)
        if tables:
            path = out / f"{name}.rst"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(table_rst(name)) + "\n")
            written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT, help="where the plots and tables go")
    args = parser.parse_args()
    for path in render(args.out, tables=True):
        print(path)


if __name__ == "__main__":
    main()
