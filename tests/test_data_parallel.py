"""One engine of data-parallel size 2, on CPU (``-dp 2``): vLLM's data parallelism inside one
engine, each rank its own EngineCore with its worker on its own core, vLLM balancing requests
between them (and a DP coordinator beside them). skyinfer counts the engine's two workers for
cores and for the trainer's group, numbers them as vLLM's own receivers do (rank 1 for data-parallel
rank 0's worker, rank 2 for rank 1's: before, both took rank 1 and the group never formed), and
reads every rank's answer to its worker calls (``AsyncLLM.collective_rpc`` returns rank 0's alone).

Each rank is judged by itself: a request with vLLM's ``X-data-parallel-rank`` header is served by
that rank, and vLLM's per-tensor checksums carry each worker's rank. A mixture-of-experts model
cannot run data-parallel on vLLM 0.32's CPU backend (its first request kills the engine, in vllm
serve too): refused up front, in tests/test_layout.py, and on GPUs tools/gpu_check.py's ``dp``.
"""

from __future__ import annotations

import threading
import time

import httpx
import psutil
import pytest

from pushes import PROMPTS, modified_weights, reference_logprobs, run_trainer, save, start_trainer
from support import ServerProcess, killed_until_stale, module_servers, until_engine, worker_processes

DP2 = ("-dp", "2", "--dtype", "float32", "--health-interval", "1", "--enable-prompt-tokens-details")
RANKS = (0, 1)
# How long a rank's load waits after each answer before its next request
# (test_staged_pushes_land_on_both_ranks_while_both_serve says why).
LOAD_PACE_S = 0.1


def _launch(demo_model, logs) -> ServerProcess:
    return ServerProcess(demo_model, engines=1, log_path=logs / "dp2.log", extra_args=DP2)


dp2_server = module_servers(__name__, _launch)


def engine_cores(server: ServerProcess) -> list[psutil.Process]:
    """The engine's EngineCores, one per data-parallel rank, in rank order."""
    engine = psutil.Process(server.engines()[0]["pid"])
    cores = sorted((p for p in engine.children(recursive=True) if p.name().startswith("VLLM::EngineCor")), key=_title)
    assert [_title(p) for p in cores] == ["VLLM::EngineCore_DP0", "VLLM::EngineCore_DP1"]
    return cores


def _title(proc: psutil.Process) -> str:
    return " ".join(proc.cmdline()).strip()


def worker_cores(server: ServerProcess) -> list[list[int]]:
    """Each rank's worker's cores, in rank order (one worker under each rank's EngineCore)."""
    workers = [worker_processes(core) for core in engine_cores(server)]
    assert [len(w) for w in workers] == [1, 1], workers
    return [w.cpu_affinity() for (w,) in workers]


def assert_each_rank_serves(server: ServerProcess, model_name: str, demo_model, weights: dict, version: str) -> None:
    """Each data-parallel rank, asked by itself, serves greedy logprobs of ``weights`` (transformers
    float32) under ``version``."""
    for prompt in PROMPTS:
        prompt_ids = httpx.post(
            f"{server.url}/tokenize", json={"model": model_name, "prompt": prompt}, timeout=30
        ).json()["tokens"]
        for rank in RANKS:
            r = httpx.post(
                f"{server.url}/v1/completions",
                json={"model": model_name, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 1,
                      "return_token_ids": True, "ignore_eos": True},
                headers={"X-data-parallel-rank": str(rank)},
                timeout=120,
            )  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.headers["X-Weight-Version"] == version
            choice = r.json()["choices"][0]
            expected = reference_logprobs(demo_model, weights, prompt_ids, choice["token_ids"])
            diff = max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], expected, strict=True))
            assert diff < 0.05, f"data-parallel rank {rank}, {prompt!r}: logprobs differ by {diff:.4f}"


def checksums_by_rank(server: ServerProcess) -> dict[str, dict[str, str]]:
    """vLLM's per-tensor digests of the engine's weights, by data-parallel rank (``dp0``, ``dp1``)."""
    r = httpx.post(f"{server.url}/weight_checker", json={"action": "checksum"}, timeout=120)
    assert r.status_code == 200, r.text
    by_rank: dict[str, dict[str, str]] = {}
    for key, digest in r.json()["checksums"].items():
        rank, _, name = key.partition(":")
        by_rank.setdefault(rank, {})[name] = digest
    assert sorted(by_rank) == ["dp0", "dp1"], sorted(by_rank)
    return by_rank


def cached_tokens(server: ServerProcess, model_name: str, prompt: str, headers: dict) -> int:
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0},
        headers=headers,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def pushed(demo_model, tmp_path_factory) -> dict[str, tuple[dict, object]]:
    root = tmp_path_factory.mktemp("dp2-weights")
    weights = {
        label: modified_weights(demo_model, seed) for label, seed in (("a", 21), ("s", 24), ("b", 22), ("c", 23))
    }
    return {label: (w, save(w, root / f"{label}.safetensors")) for label, w in weights.items()}


def test_one_engine_spans_two_data_parallel_ranks_each_on_its_own_core(dp2_server, model_name, demo_model):
    (engine,) = dp2_server.engines()
    assert (engine["tensor_parallel_size"], engine["pipeline_parallel_size"], engine["data_parallel_size"]) == (1, 1, 2)
    assert engine["devices"]["ids"] == [0, 1]
    assert worker_cores(dp2_server) == [[0], [1]]
    assert httpx.get(f"{dp2_server.url}/get_world_size", timeout=30).json()["world_size"] == 2
    assert_each_rank_serves(dp2_server, model_name, demo_model, {}, "default")
    # A rank the engine does not have is the caller's mistake.
    r = httpx.post(
        f"{dp2_server.url}/v1/completions",
        json={"model": model_name, "prompt": "x", "max_tokens": 1},
        headers={"X-data-parallel-rank": "2"},
        timeout=60,
    )
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"], r.text


def test_a_sessions_turns_stay_on_one_rank_and_find_their_prefix_cached(dp2_server, model_name):
    """vLLM balances each request among the ranks by load, alternating between idle ones: a
    session's second turn would go to the rank that never saw its first. The engine keeps each
    session on one rank (picked by its id), so every next turn finds the turns before it cached;
    a caller's own ``X-data-parallel-rank`` still wins."""
    history = " ".join(f"turn {i} of a long conversation about weights and rewards;" for i in range(40))
    for session in ("episode-1", "episode-2", "episode-3", "episode-4"):
        headers = {"X-Session-ID": session}
        assert cached_tokens(dp2_server, model_name, f"{session}: {history}", headers) == 0
        for turn in range(2):
            history += f" and then turn {turn} of {session} answered"
            assert cached_tokens(dp2_server, model_name, f"{session}: {history}", headers) > 0, (session, turn)
    # The session's rank is its id's, unless the caller names one: the other rank holds nothing of it.
    other = {"X-Session-ID": "episode-5"}
    assert cached_tokens(dp2_server, model_name, f"episode-5: {history}", other) == 0
    ranks = [
        cached_tokens(dp2_server, model_name, f"episode-5: {history}", {**other, "X-data-parallel-rank": r})
        for r in "01"
    ]
    assert sorted(ranks) == [0, max(ranks)] and max(ranks) > 0, ranks


def test_a_push_lands_on_both_ranks(dp2_server, model_name, demo_model, pushed):
    """skyinfer's trainer (a process of its own) pushes into a group of 3: the worker of each rank
    joins as its own rank and takes every tensor."""
    before = checksums_by_rank(dp2_server)
    assert before["dp0"] == before["dp1"]
    weights, path = pushed["a"]
    done = run_trainer(dp2_server, path, "dp2-a")
    assert done.returncode == 0 and "pushed dp2-a" in done.stdout, done.stdout + done.stderr[-3000:]
    after = checksums_by_rank(dp2_server)
    assert after["dp0"] == after["dp1"]
    changed = {name for name in after["dp1"] if after["dp1"][name] != before["dp1"][name]}
    assert any("q_proj" in n or "qkv_proj" in n for n in changed) and any("embed_tokens" in n for n in changed)
    assert_each_rank_serves(dp2_server, model_name, demo_model, weights, "dp2-a")


def test_staged_pushes_land_on_both_ranks_while_both_serve(dp2_server, model_name, demo_model, pushed):
    """Staged pushes one after another while requests go to both ranks: each lands on both (their
    checksums equal and new), each rank answers requests while each push runs, no request fails,
    and each rank then serves the last weights. The engine asked every worker how its staging went
    every 10 ms: each ask woke both EngineCores and both workers, which took more than this
    machine's two cores, and pushes of a few MB took 30-60 s, a quarter of them timing out in the
    receive (engine/weights.py).

    Each rank gets a request every ``LOAD_PACE_S`` after its last answer, not one after another:
    answers back to back took both cores for as long as the pushes ran, the trainers' start-up
    waited for them, and the module took 440-503 s of ``.ci/run`` (257 s paced; docs: benchmarks-journal,
    "A load that took both cores")."""
    failures: list[str] = []
    served = dict.fromkeys(RANKS, 0)
    stop = threading.Event()

    def load(rank: int) -> None:
        with httpx.Client(timeout=120) as http:
            while not stop.wait(LOAD_PACE_S):
                r = http.post(
                    f"{dp2_server.url}/v1/completions",
                    json={"model": model_name, "prompt": f"rank {rank} keeps serving", "max_tokens": 16,
                          "ignore_eos": True},
                    headers={"X-data-parallel-rank": str(rank)},
                )  # fmt: skip
                if r.status_code != 200:
                    failures.append(r.text)
                served[rank] += 1

    callers = [threading.Thread(target=load, args=(rank,), daemon=True) for rank in RANKS]
    for caller in callers:
        caller.start()
    try:
        previous = checksums_by_rank(dp2_server)
        for push in range(3):
            label = "sa"[push % 2]
            served_before = dict(served)
            done = run_trainer(dp2_server, pushed[label][1], f"dp2-staged-{push}", "--staged")
            assert done.returncode == 0, done.stdout + done.stderr[-3000:]
            assert all(served[rank] > served_before[rank] for rank in RANKS), (push, served_before, served)
            now = checksums_by_rank(dp2_server)
            assert now["dp0"] == now["dp1"] != previous["dp0"], push
            previous = now
    finally:
        stop.set()
        for caller in callers:
            caller.join(120)
    assert not failures, failures[:3]
    assert_each_rank_serves(dp2_server, model_name, demo_model, pushed["s"][0], "dp2-staged-2")


def test_a_trainer_killed_mid_staging_costs_both_ranks_nothing_and_the_next_staged_push_lands(
    dp2_server, model_name, demo_model, pushed
):
    """A trainer hangs after 3 tensors of a staged push into the dp-2 engine, both ranks' workers
    receiving on their staging threads, and is SIGKILLed: the copies are dropped, the engine is not
    restarted nor held out, both ranks keep the weights they served bit for bit; the next staged
    push lands on both."""
    cores = [p.pid for p in engine_cores(dp2_server)]
    before = checksums_by_rank(dp2_server)
    (engine,) = dp2_server.engines()
    version = engine["weight_version"]
    trainer = start_trainer(dp2_server, pushed["b"][1], "never-served", "--staged", "--hang-after", "3")
    try:
        line = trainer.stdout.readline()
        assert line.strip() == "hanging", line + trainer.stderr.read()
        until_engine(dp2_server, lambda e: (e["staging"] or {}).get("state") == "receiving", timeout_s=60)
    finally:
        trainer.kill()
        trainer.wait()
    engine = until_engine(dp2_server, lambda e: e["staging"] is None and not e["receiving"], timeout_s=120)
    assert (engine["state"], engine["stale_reason"], engine["weight_version"]) == ("ready", None, version), engine
    assert engine["restarts"] == 0 and [p.pid for p in engine_cores(dp2_server)] == cores
    deadline = time.monotonic() + 120
    while httpx.get(f"{dp2_server.url}/weight_info", timeout=60).json()["update_phase"] != "idle":
        assert time.monotonic() < deadline, "the killed trainer's update never ended"
        time.sleep(0.2)
    assert checksums_by_rank(dp2_server) == before
    weights, path = pushed["a"]
    done = run_trainer(dp2_server, path, "dp2-staged-after-kill", "--staged")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert_each_rank_serves(dp2_server, model_name, demo_model, weights, "dp2-staged-after-kill")


def test_a_trainer_killed_mid_push_costs_no_restart_and_the_next_push_lands_on_both_ranks(
    dp2_server, model_name, demo_model, pushed
):
    cores = [p.pid for p in engine_cores(dp2_server)]
    _, path = pushed["b"]
    died = run_trainer(dp2_server, path, "never-served", "--die-after", "3")
    assert died.returncode == 9, died.stdout + died.stderr[-3000:]
    engine = until_engine(dp2_server, lambda e: e["state"] == "stale", timeout_s=60)
    assert engine["restarts"] == 0 and [p.pid for p in engine_cores(dp2_server)] == cores
    weights, path = pushed["b"]
    done = run_trainer(dp2_server, path, "dp2-b")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert_each_rank_serves(dp2_server, model_name, demo_model, weights, "dp2-b")


def test_rank_1s_engine_core_killed_brings_the_whole_engine_back_and_the_next_push_lands_on_both(
    dp2_server, model_name, demo_model, pushed
):
    """SIGKILL of data-parallel rank 1's EngineCore: the engine (every rank, the coordinator) is
    replaced, nothing of it left behind, stale until the next push, which lands on both ranks."""
    old = psutil.Process(dp2_server.engines()[0]["pid"])
    old_tree = [old, *old.children(recursive=True)]
    killed_until_stale(dp2_server, engine_cores(dp2_server)[1], "dp 2, rank 1's EngineCore")
    left = psutil.wait_procs(old_tree, timeout=15)[1]
    assert not left, f"left behind: {[(p.pid, _title(p)) for p in left]}"
    assert worker_cores(dp2_server) == [[0], [1]]
    weights, path = pushed["c"]
    done = run_trainer(dp2_server, path, "dp2-c")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert_each_rank_serves(dp2_server, model_name, demo_model, weights, "dp2-c")
    after = checksums_by_rank(dp2_server)
    assert after["dp0"] == after["dp1"]
