#!/usr/bin/env python
"""Soak: many weight pushes into two engines under load. Does each engine's memory stay flat, does
every request come back whole, are the last weights exact?

``skyinfer serve --engines 2`` serves a synthetic Qwen2 in float32 (``--model-mib`` MiB of float32
weights: bench_weight_sync's shape, as deep as that takes; 0: the demo model). A trainer in a
process of its own (``GlooTrainer``) pushes ``--pushes`` times, the three ways in turn, each a
one-call ``/update_weights``:

* ``pause``: the engines paused for the whole push (KV recomputed);
* ``staged``: received while the engines generate, paused for the swap alone (KV recomputed);
* ``staged-keep``: the same, the running requests going on over the KV they have.

Two sets of weights alternate (the checkpoint's plus noise of their own seed), so the last push
is told from the one before. Meanwhile ``--clients`` callers send completions without a break
(every other one streamed): a response is whole when it ends as asked (``max_tokens`` tokens,
finish reason ``length``, a stream's ``[DONE]`` and no error event). After every ``--every``-th
push: each engine's resident memory (its process, EngineCore and workers; on a GPU, also their
device memory) and the requests so far. At the end: each engine's memory after the last push
over its memory after the ``--every``-th, prompt logprobs of each engine beside a transformers
float32 forward on the last pushed weights (and, for contrast, on the other set), and PASS/FAIL.

    .venv/bin/python tools/bench_soak.py                                 # 200 pushes, about 180 MiB
    .venv/bin/python tools/bench_soak.py --pushes 20 --model-mib 0      # the demo model: a rehearsal

``tools/gpu_check.py --only soak`` runs 20 staged pushes on a GPU (colocated: CUDA IPC) with the
pieces here.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import aiohttp
import httpx
import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_weight_sync import BENCH_MODEL

from benchlib import (
    bench_parser,
    free_port,
    gpu_memory_mib,
    sized_demo_model,
    start_skyinfer,
    stop,
    tree_processes,
    wait_servers,
    write_json,
)

MODES = {
    "pause": {"one_call": True},
    "staged": {"one_call": True, "staged": True},
    "staged-keep": {"one_call": True, "staged": True, "kv": "keep"},
}
SHAPE = {k: v for k, v in BENCH_MODEL.items() if k != "num_hidden_layers"}
ENGINE_ARGS = ["--dtype", "float32", "--cpu-kvcache-gib", "1", "--max-model-len", "512", "--warm-spares", "0"]
# Absolute noise per weight (the demo model is initialised with std 0.25): the two sets' logprobs
# differ by far more than the tolerance.
NOISE = 0.02
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Reinforcement learning updates a policy", "def main():"]
ENGINE_HEADER = "X-Skyinfer-Engine"


# -- the weights ------------------------------------------------------------------------


def soak_weights(model_dir: Path, which: int) -> list[tuple[str, torch.Tensor]]:
    """Set ``which`` (0 or 1): the checkpoint's tensors in float32 plus noise of the set's own seed."""
    from safetensors.torch import load_file

    generator = torch.Generator().manual_seed(1000 + which)
    tensors = sorted(load_file(model_dir / "model.safetensors").items())
    return [(name, t.float() + torch.randn(t.shape, generator=generator) * NOISE) for name, t in tensors]


# -- the trainer, in a process of its own ----------------------------------------------


def _trainer(transport: str, url: str, admin_key: str | None):
    """``gloo``: engines on devices of their own (CPU); ``shm``, ``ipc``: colocated on CPU, on GPUs."""
    from skyinfer.trainer import GlooTrainer, IPCTrainer, SharedMemoryTrainer

    kinds = {"gloo": GlooTrainer, "shm": SharedMemoryTrainer, "ipc": IPCTrainer}
    return kinds[transport](url, admin_key=admin_key, timeout_s=600)


def _trainer_loop(transport: str, url: str, model_dir: str, admin_key: str | None, commands) -> None:
    """Set up the transfer once, then one push per command, answering its seconds (or the error)."""
    sets = [soak_weights(Path(model_dir), which) for which in (0, 1)]
    if transport == "ipc":  # on the GPU once, not a copy per push
        sets = [[(name, t.cuda()) for name, t in tensors] for tensors in sets]
    trainer = _trainer(transport, url, admin_key)
    trainer.init()
    commands.send("ready")
    while (command := commands.recv()) is not None:
        which, version, mode = command
        started = time.monotonic()
        try:
            trainer.push(sets[which], version, **MODES[mode])
            commands.send(time.monotonic() - started)
        except Exception as exc:
            commands.send(f"{type(exc).__name__}: {str(exc)[:300]}")
    trainer.close()


class Pusher:
    """The trainer's process, driven from here: ``push`` answers the push's seconds or raises."""

    def __init__(self, url: str, model_dir: Path, transport: str = "gloo", admin_key: str | None = None):
        context = multiprocessing.get_context("spawn")
        self._commands, theirs = context.Pipe()
        args = (transport, url, str(model_dir), admin_key, theirs)
        self.process = context.Process(target=_trainer_loop, args=args, daemon=True)
        self.process.start()
        if self._commands.recv() != "ready":
            raise RuntimeError("the trainer did not start")

    def push(self, which: int, version: str, mode: str) -> float:
        self._commands.send((which, version, mode))
        answer = self._commands.recv()
        if isinstance(answer, str):
            raise RuntimeError(answer)
        return answer

    def close(self) -> None:
        self._commands.send(None)
        self.process.join(60)


# -- the load ---------------------------------------------------------------------------


class Load:
    """``clients`` callers, each sending a completion as soon as its last one ended (every other
    caller streamed), on a thread of their own until ``stop``; each response whole or failed."""

    def __init__(self, url: str, model: str, clients: int = 4, max_tokens: int = 32):
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.done = self.failed = 0
        self.by_engine: Counter[str] = Counter()
        self.problems: list[str] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(clients),), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(900)

    async def _run(self, clients: int) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
            await asyncio.gather(*(self._caller(http, i) for i in range(clients)))

    async def _caller(self, http: aiohttp.ClientSession, i: int) -> None:
        streamed, n = i % 2 == 1, 0
        while not self._stopping.is_set():
            n += 1
            body = {"model": self.model, "prompt": f"caller {i} request {n}: {PROMPTS[n % len(PROMPTS)]}",
                    "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 1.0}  # fmt: skip
            if streamed:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            engine = "?"
            try:
                async with http.post(f"{self.url}/v1/completions", json=body) as r:
                    engine = r.headers.get(ENGINE_HEADER, "?")
                    if r.status != 200:
                        problem = f"status {r.status}: {(await r.text())[:200]}"
                    else:
                        problem = await (self._streamed(r) if streamed else self._plain(r))
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            self.by_engine[engine] += 1
            if problem is None:
                self.done += 1
            else:
                self.failed += 1
                self.problems.append(f"caller {i} request {n} (engine {engine}): {problem}")

    def _short(self, usage: dict | None, finish: str | None) -> str | None:
        tokens = (usage or {}).get("completion_tokens")
        if tokens != self.max_tokens or finish != "length":
            return f"{tokens} of {self.max_tokens} tokens, finish reason {finish!r}"
        return None

    async def _plain(self, r: aiohttp.ClientResponse) -> str | None:
        body = await r.json()
        return self._short(body.get("usage"), body["choices"][0].get("finish_reason"))

    async def _streamed(self, r: aiohttp.ClientResponse) -> str | None:
        usage, finish, last = None, None, b""
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            last = line
            if line == b"data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if "error" in event:
                return f"error event: {str(event['error'])[:200]}"
            usage = event.get("usage") or usage
            finish = next((c["finish_reason"] for c in event.get("choices", []) if c.get("finish_reason")), finish)
        if last != b"data: [DONE]":
            return f"no [DONE] (last event {last[:100]!r})"
        return self._short(usage, finish)


# -- the last weights ---------------------------------------------------------------------


def served_prompt_logprobs(url: str, model: str, engines: int) -> tuple[list[list[int]], dict[str, list]]:
    """PROMPTS' tokens, and each engine's logprobs of them (a session per engine, found by trying)."""
    found: dict[str, list[list[float]]] = {}
    with httpx.Client(base_url=url, timeout=300) as http:
        ids = [http.post("/tokenize", json={"model": model, "prompt": p}).json()["tokens"] for p in PROMPTS]
        for session in range(200):
            headers, got, engine = {"X-Session-ID": f"check-{session}"}, [], None
            for prompt_ids in ids:
                body = {"model": model, "prompt": prompt_ids, "max_tokens": 1, "prompt_logprobs": 0}
                r = http.post("/v1/completions", json=body, headers=headers)
                r.raise_for_status()
                engine = r.headers[ENGINE_HEADER]
                entries = r.json()["choices"][0]["prompt_logprobs"][1:]
                got.append([entry[str(tok)]["logprob"] for entry, tok in zip(entries, prompt_ids[1:])])
            found.setdefault(engine, got)
            if len(found) == engines:
                break
    return ids, found


def reference_prompt_logprobs(model_dir: Path, weights, ids: list[list[int]], device: str) -> list[list[float]]:
    """transformers float32 on ``weights``: each prompt token's logprob given the ones before it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(dict(weights), strict=False)
    model.tie_weights()
    model = model.to(device)
    out = []
    with torch.no_grad():
        for prompt_ids in ids:
            logprobs = model(torch.tensor([prompt_ids], device=device)).logits[0].float().log_softmax(-1)
            out.append([logprobs[i, tok].item() for i, tok in enumerate(prompt_ids[1:])])
    return out


def last_weights_gaps(
    url: str, model: str, model_dir: Path, last: int, engines: int, device: str = "cpu", refs: list | None = None
) -> dict[str, tuple[float, float]]:
    """Per engine: max |served - reference| of the prompt logprobs, on the last pushed set and on the other.
    ``refs``: a list to keep the references in (transformers on each set), filled by the first call
    and read by the next (a forward of a wide model on each set takes seconds of a lent GPU)."""
    ids, served = served_prompt_logprobs(url, model, engines)
    refs = [] if refs is None else refs
    if not refs:
        refs += [
            reference_prompt_logprobs(model_dir, soak_weights(model_dir, w), ids, device) for w in (last, 1 - last)
        ]

    def gap(got, ref) -> float:
        return max(abs(a - b) for g, r in zip(got, ref) for a, b in zip(g, r))

    return {engine: (gap(got, refs[0]), gap(got, refs[1])) for engine, got in served.items()}


# -- the soak -----------------------------------------------------------------------------


def engine_pids(url: str) -> dict[str, tuple[int, int]]:
    """Each engine's (pid, restarts), as the front reports them."""
    return {str(e["id"]): (e["pid"], e.get("restarts", 0)) for e in httpx.get(f"{url}/engines").json()["engines"]}


class Table:
    """The table's rows as they come: each engine's memory (its process tree's) after a push."""

    def __init__(self, engines: list[str]):
        self.engines = engines
        self.samples: dict[int, dict[str, tuple[float, float | None]]] = {}
        self.processes: dict[int, dict[str, dict[str, float]]] = {}
        cells = "".join(f" {'engine ' + e + ' RSS':>16}" for e in engines)
        print(f"{'push':>5} {'mode':11} {'push s':>7}{cells} {'whole':>7} {'failed':>7}", flush=True)

    def row(self, url: str, push: int, mode: str, seconds: float | None, load: Load) -> None:
        processes = self.processes[push] = {}
        memory = self.samples[push] = {}
        for e, (pid, _) in engine_pids(url).items():
            tree = tree_processes(pid)
            processes[e] = {f"{name} {p}": rss for p, (name, rss) in tree.items()}
            memory[e] = (sum(processes[e].values()), gpu_memory_mib(set(tree)))
        cells = ""
        for e in self.engines:
            rss, gpu = memory.get(e, (float("nan"), None))
            cells += f" {rss:12.0f} MiB" + ("" if gpu is None else f" ({gpu:.0f} MiB device)")
        took = "" if seconds is None else f"{seconds:.2f}"
        print(f"{push:5d} {mode:11} {took:>7}{cells} {load.done:7d} {load.failed:7d}", flush=True)


def soak(args, url: str, pusher: Pusher, load: Load, table: Table) -> tuple[dict[str, list[float]], list[str]]:
    """The pushes, the modes in turn; the memory after every ``args.every``-th and after the last."""
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    failures: list[str] = []
    for push in range(1, args.pushes + 1):
        mode = list(MODES)[(push - 1) % len(MODES)]
        try:
            seconds = pusher.push(push % 2, f"soak-{push}", mode)
            times[mode].append(seconds)
        except RuntimeError as exc:
            seconds = None
            failures.append(f"push {push} ({mode}): {exc}")
            print(f"push {push} ({mode}) failed: {exc}", flush=True)
        if push % args.every == 0 or push == args.pushes:
            # A push's finish answers before the weights it replaced are freed (on a thread of each
            # worker): read once they had time to go, as the memory the engine holds between pushes.
            time.sleep(args.settle_s)
            table.row(url, push, mode, seconds, load)
        time.sleep(args.gap_s)
    return times, failures


def verdict(name: str, ok: bool, figure: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {figure}")
    return ok


def report(args, table, times, failures, load, gaps, pids_before, pids_after) -> bool:
    print(f"\npush seconds per mode: median, max (over {args.pushes} pushes)")
    for mode, seconds in times.items():
        if seconds:
            print(f"  {mode:11} {statistics.median(seconds):6.2f} {max(seconds):6.2f}  ({len(seconds)} pushes)")
    print(f"requests per engine: {dict(sorted(load.by_engine.items()))}")
    for problem in load.problems[:10]:
        print(f"  failed: {problem}")
    last_push = max(table.samples)
    base, last = table.samples.get(args.every), table.samples[last_push]
    ok = True
    for engine in table.engines:
        if base is None:
            ok &= verdict(f"engine {engine} memory", False, f"no sample after push {args.every}")
            continue
        before, after = table.processes[args.every][engine], table.processes[last_push][engine]
        grew = ", ".join(f"{name} {mib:.0f} -> {after.get(name, 0):.0f}" for name, mib in before.items())
        print(f"engine {engine}'s processes, RSS MiB after push {args.every} -> {last_push}: {grew}")
        (rss0, gpu0), (rss1, gpu1) = base[engine], last[engine]
        per_push = (rss1 - rss0) / max(1, last_push - args.every)
        figure = (
            f"RSS {rss0:.0f} -> {rss1:.0f} MiB ({per_push:+.1f} MiB per push),"
            f" after push {last_push} / after push {args.every}: {rss1 / rss0:.3f}"
        )
        flat = abs(rss1 / rss0 - 1) <= args.memory_tolerance
        if gpu0:
            figure += f"; device {gpu0:.0f} -> {gpu1:.0f} MiB, {gpu1 / gpu0:.3f}"
            flat &= abs(gpu1 / gpu0 - 1) <= args.memory_tolerance
        ok &= verdict(f"engine {engine} memory", flat, figure)
    ok &= verdict("pushes", not failures, f"{args.pushes - len(failures)} of {args.pushes} returned")
    ok &= verdict("requests", load.failed == 0 and load.done > 0, f"{load.done} whole, {load.failed} failed")
    restarted = {e: (pids_before.get(e), now) for e, now in pids_after.items() if pids_before.get(e) != now}
    ok &= verdict("engines", not restarted, f"(pid, restarts) changed: {restarted}" if restarted else "no restart")
    for engine in table.engines:
        last_gap, other_gap = gaps.get(engine, (float("inf"), float("nan")))
        figure = (
            f"max |served - transformers fp32| {last_gap:.4f} on the last weights ({other_gap:.4f} on the other set)"
        )
        ok &= verdict(f"engine {engine} last weights", last_gap <= args.tolerance < other_gap, figure)
    print("PASS" if ok else "FAIL")
    # --json: each engine's memory after every --every-th push (the rows), and the verdicts' figures.
    rows = [
        {"push": push, "engine": engine, "rss_mib": rss, **({"device_mib": gpu} if gpu else {})}
        for push, by_engine in sorted(table.samples.items())
        for engine, (rss, gpu) in sorted(by_engine.items())
    ]
    summary = {
        "ok": ok,
        "rss_last_over_every": {e: last[e][0] / base[e][0] for e in table.engines if base and e in base and e in last},
        "push_s_p50": {mode: statistics.median(seconds) for mode, seconds in times.items() if seconds},
        "pushes_returned": args.pushes - len(failures),
        "requests_whole": load.done,
        "requests_failed": load.failed,
        "engines_restarted": sorted(restarted),
        "last_weights_gap": {engine: gap[0] for engine, gap in gaps.items()},
        "other_weights_gap": {engine: gap[1] for engine, gap in gaps.items()},
    }
    write_json(args, rows, summary=summary)
    return ok


def main() -> int:
    p = bench_parser(__doc__)
    p.add_argument("--pushes", type=int, default=200)
    p.add_argument("--model-mib", type=float, default=160, help="float32 MiB of weights at least; 0: the demo model")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--clients", type=int, default=4, help="callers sending completions without a break")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--every", type=int, default=10, help="the memory after every N-th push")
    p.add_argument("--gap-s", type=float, default=0.5, help="between two pushes (the load goes on)")
    p.add_argument("--settle-s", type=float, default=2.0, help="after a push, before its memory is read")
    p.add_argument("--tolerance", type=float, default=0.05, help="logprobs: served vs transformers float32")
    p.add_argument("--memory-tolerance", type=float, default=0.10, help="last / every-th memory, either way")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        model_dir = sized_demo_model(Path(tmp), args.model_mib, 4, **SHAPE)
        params = sum(t.numel() for _, t in soak_weights(model_dir, 0))
        print(f"model {model_dir.name}: {params * 4 / 2**20:.0f} MiB float32 ({params / 1e6:.1f}M parameters)")
        port = free_port()
        server = start_skyinfer(
            str(model_dir), port, ENGINE_ARGS, dict(os.environ), engines=args.engines, log_name="bench-soak.log"
        )
        url = f"http://127.0.0.1:{port}"
        try:
            asyncio.run(wait_servers([(url, server)], path="/ready"))
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            pids_before = engine_pids(url)
            pusher = Pusher(url, model_dir)
            load = Load(url, model, args.clients, args.max_tokens)
            table = Table(sorted(pids_before))
            started = time.monotonic()
            table.row(url, 0, "(start)", None, load)
            times, failures = soak(args, url, pusher, load, table)
            load.stop()
            pusher.close()
            print(f"{args.pushes} pushes in {time.monotonic() - started:.0f} s")
            pids_after = engine_pids(url)
            gaps = last_weights_gaps(url, model, model_dir, args.pushes % 2, args.engines)
        finally:
            stop(server)
        return 0 if report(args, table, times, failures, load, gaps, pids_before, pids_after) else 1


if __name__ == "__main__":
    sys.exit(main())
