"""Warm restarts (``--warm-spares``, on by default): once the fleet is ready each engine has a spare
process that has imported torch and vLLM and waits; a restart, after a crash or on request, makes the
spare the engine's process instead of starting a cold one, and a new spare starts once the engine is
up. Real engines: a one-engine server with spares and one without, started together, each on a core
of its own. The front's side alone (templates without an engine, the spares' supervisor over fake
engines) is test_spare_supervision's.
"""

from __future__ import annotations

import concurrent.futures
import os
import shlex
import signal
import time
from pathlib import Path

import httpx
import psutil

from skyinfer.devices import WORKER_PROCESSES_ENV

from support import (
    NO_SPARES,
    WORKER_PROCESSES,
    ServerProcess,
    SharedEngineTemplate,
    engine_socket,
    engine_tree,
    left_in_shm,
    module_servers,
    running,
    shm_segments,
    vllm_process,
)

# A spare imports torch and vLLM on one busy core: it may take a while.
SPARE_TIMEOUT_S = 300


def _launch(demo_model: Path, logs: Path) -> dict[str, ServerProcess]:
    """One-engine servers, started together, each on a core of its own: spares and engine templates
    on (the defaults), and both off. Health probes fast enough for a test."""
    probes = ("--health-interval", "1", "--health-timeout", "4")
    return {
        "warm": ServerProcess(
            demo_model,
            engines=1,
            log_path=logs / "warm.log",
            extra_args=(*probes, "--loaded-spares", "auto", "--engine-templates", "auto"),
            cpus={0},
        ),
        "cold": ServerProcess(
            demo_model,
            engines=1,
            log_path=logs / "cold.log",
            extra_args=(*probes, "--warm-spares", "0", "--engine-templates", "off"),
            cpus={1},
        ),
    }


servers = module_servers(__name__, _launch)


def spares_of(srv: ServerProcess) -> list[psutil.Process]:
    """The front's spare processes (children of the front, or of its engine template): started with
    --standby, and not the engine (an engine that was a spare keeps --standby in its command line)."""
    engine_pid = srv.engines()[0]["pid"]
    children = psutil.Process(srv.proc.pid).children(recursive=True)
    return [p for p in children if p.pid != engine_pid and _cmdline(p) and "--standby" in _cmdline(p)]


def templates_of(srv: ServerProcess) -> list[psutil.Process]:
    """The front's engine templates (``--engine-templates``): its children that fork engines."""
    return [p for p in psutil.Process(srv.proc.pid).children() if "skyinfer.engine.template" in _cmdline(p)]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:  # gone, or a zombie
        return []


def waiting_spare(srv: ServerProcess) -> psutil.Process:
    """The engine's spare, once ``GET /engines`` says it stands by."""
    deadline = time.monotonic() + SPARE_TIMEOUT_S
    while srv.engines()[0]["spare"] != "waiting":
        assert time.monotonic() < deadline, f"no spare stands by:\n{srv.log_tail()}"
        time.sleep(0.5)
    (spare,) = spares_of(srv)
    return spare


def back_up(srv: ServerProcess, old_pid: int, timeout_s: float = 300) -> dict:
    """The engine, once a process other than ``old_pid`` serves."""
    deadline = time.monotonic() + timeout_s
    while (engine := srv.engines()[0])["state"] != "ready" or engine["pid"] == old_pid:
        assert time.monotonic() < deadline, f"{engine}\n{srv.log_tail()}"
        time.sleep(0.2)
    return engine


def completes(srv: ServerProcess) -> None:
    r = httpx.post(
        f"{srv.url}/v1/completions", json={"model": srv.model, "prompt": "back?", "max_tokens": 4}, timeout=120
    )
    assert r.status_code == 200 and r.headers["X-Skyinfer-Engine"] == "0", r.text


def test_a_spare_stands_by_once_the_fleet_is_ready(servers):
    """The spare: a child of the front beside the engine, with the engine's own command line
    (socket, log prefix, cores) and --standby, holding torch (and vLLM) but no EngineCore, on its
    engine's cores. The server without spares has none."""
    warm = servers["warm"]
    spare = waiting_spare(warm)
    engine = psutil.Process(warm.engines()[0]["pid"])
    # Its process title: the command line it was forked for, quoted as a shell would.
    argv = shlex.split(" ".join(spare.cmdline()))
    assert argv[argv.index("--socket") + 1] == engine_socket(warm, 0)
    assert argv[argv.index("--log-prefix") + 1] == "[engine 0] "
    # Both forked from the front's one engine template; their command lines their own.
    (template,) = templates_of(warm)
    assert "--standby" not in engine.cmdline() and spare.ppid() == engine.ppid() == template.pid
    assert engine.pid == os.getpgid(engine.pid) and spare.pid == os.getpgid(spare.pid)
    libraries = {os.path.basename(m.path) for m in spare.memory_maps()}
    assert any(name.startswith("libtorch_cpu") for name in libraries), sorted(libraries)
    # On CPU the spare builds its whole engine before it waits: vLLM's EngineCore and worker
    # beneath it, on its engine's cores, the model loaded (said in the spare's own output).
    assert "--loaded" in argv
    tree = [spare, *(p for p in spare.children(recursive=True) if "VLLM" in " ".join(_cmdline(p)))]
    assert any("EngineCore" in " ".join(_cmdline(p)) for p in tree), [_cmdline(p) for p in tree]
    assert all(p.cpu_affinity() == [0] for p in tree) and engine.cpu_affinity() == [0]
    log = warm.log_path.read_text(errors="replace")
    started = log.index(f"starting a warm spare, pid {spare.pid}")
    standing = log.index(f"warm spare pid {spare.pid} stands by (its engine built", started)
    assert "Loading safetensors checkpoint" in log[started:standing], warm.log_tail()
    cpu = sum(p.cpu_times().user + p.cpu_times().system for p in tree)
    resident = sum(p.memory_info().rss for p in tree) / 2**20
    print(
        f"\na loaded spare standing by: {cpu:.1f} CPU-s to start, {resident:.0f} MiB resident ({len(tree)} processes)"
    )
    cold = servers["cold"]
    assert cold.engines()[0]["spare"] is None and spares_of(cold) == []
    # The server without templates started its engine cold, a child of the front; both answer alike.
    assert templates_of(cold) == [] and psutil.Process(cold.engines()[0]["pid"]).ppid() == cold.proc.pid
    assert greedy(warm) == greedy(cold)


def test_an_enginecore_killed_is_replaced_by_the_spare(servers):
    """SIGKILL of the EngineCore: the engine process exits, and the new engine process is the spare
    (its pid), whose output goes on under the engine's prefix; it serves, and a new spare stands by
    once it is up."""
    warm = servers["warm"]
    spare = waiting_spare(warm)
    engine_pid = warm.engines()[0]["pid"]
    vllm_process(engine_pid, "EngineCore").send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    engine = back_up(warm, engine_pid)
    print(f"\nWARM EngineCore SIGKILL: ready again {time.monotonic() - killed_at:.1f}s after")
    assert engine["pid"] == spare.pid and engine["restarts"] == 1, engine
    completes(warm)
    # The replacement runs its one worker inside its EngineCore, as the first one did: no worker process.
    # (Its environment is its engine template's, the parent it was forked from: the process title
    # of a forked process takes the room its own copy in /proc had.)
    template = psutil.Process(psutil.Process(engine["pid"]).ppid())
    assert "skyinfer.engine.template" in _cmdline(template)
    assert template.environ().get(WORKER_PROCESSES_ENV) == "0"
    assert not vllm_process(engine["pid"], "EngineCore").children(), "a worker process under the EngineCore"
    # From the takeover on, the spare's output (its vLLM processes' too) goes under the engine's
    # prefix, none under the spare's; it loaded no model again: it had before it stood by.
    log = warm.log_path.read_text(errors="replace")
    assert f"its warm spare, pid {spare.pid}, takes over" in log, warm.log_tail()
    # The spare's first line as the engine (the front's own line about it may come before or after).
    taken = log.index(f"[engine 0] spare pid {spare.pid} takes over as the engine")
    following = log.find("starting a warm spare", taken)
    starting = log[taken : following if following > 0 else None]  # until the next spare starts
    assert "[engine 0] (spare)" not in starting and "Loading safetensors checkpoint" not in starting, warm.log_tail()
    following = waiting_spare(warm)
    assert following.pid not in (spare.pid, engine_pid)
    assert not psutil.pid_exists(engine_pid) or psutil.Process(engine_pid).status() == psutil.STATUS_ZOMBIE


def test_an_operator_restart_is_taken_by_the_spare(servers):
    """``POST /engines/0/restart``: answered once the spare, now the engine, serves; a new spare follows."""
    warm = servers["warm"]
    spare = waiting_spare(warm)
    before = warm.engines()[0]
    started = time.monotonic()
    r = httpx.post(f"{warm.url}/engines/0/restart", timeout=300)
    assert r.status_code == 200, r.text
    print(f"\nWARM operator restart: answered {time.monotonic() - started:.1f}s after")
    assert r.json()["engine"]["pid"] == spare.pid != before["pid"]
    completes(warm)
    assert waiting_spare(warm).pid != spare.pid


def test_an_engine_template_that_dies_costs_no_engine_and_its_successor_forks_the_next(servers):
    """The engine template SIGKILLed while its engine serves and its spare waits: both go on. The
    engine then SIGKILLed: its end is seen without the template (its code unknown), the spare takes
    over. The next spare needs a template: the new one is SIGKILLed while it imports, so that
    spare starts cold (a child of the front) and stands by. An operator's restart takes it; the
    spare after it forks from a third template, which then hangs: the next spare starts cold."""
    warm = servers["warm"]
    spare = waiting_spare(warm)
    (first,) = templates_of(warm)
    first.kill()
    first.wait(10)
    completes(warm)
    assert warm.engines()[0]["spare"] == "waiting"
    engine_pid = warm.engines()[0]["pid"]
    os.kill(engine_pid, signal.SIGKILL)
    assert back_up(warm, engine_pid, timeout_s=30)["pid"] == spare.pid
    completes(warm)
    deadline = time.monotonic() + SPARE_TIMEOUT_S
    while not (second := templates_of(warm)):
        assert time.monotonic() < deadline, warm.log_tail()
        time.sleep(0.05)
    (second,) = second
    second.kill()
    cold_spare = waiting_spare(warm)
    assert cold_spare.ppid() == warm.proc.pid, cold_spare.ppid()
    log = warm.log_path.read_text(errors="replace")
    assert f"process {engine_pid} exited with an unknown code (its engine template is gone)" in log, warm.log_tail()
    assert "engine template: cannot fork" in log and "this engine starts cold" in log, warm.log_tail()
    r = httpx.post(f"{warm.url}/engines/0/restart", timeout=300)
    assert r.status_code == 200 and r.json()["engine"]["pid"] == cold_spare.pid, r.text
    completes(warm)
    forked = waiting_spare(warm)
    (third,) = templates_of(warm)
    assert forked.ppid() == third.pid and third.pid not in (first.pid, second.pid)
    # Hung (SIGSTOPped): the next spare's fork order goes unanswered for the front's probe
    # timeout, the template is killed, and that spare starts cold.
    third.send_signal(signal.SIGSTOP)
    r = httpx.post(f"{warm.url}/engines/0/restart", timeout=300)
    assert r.status_code == 200 and r.json()["engine"]["pid"] == forked.pid, r.text
    completes(warm)
    after_hang = waiting_spare(warm)
    assert after_hang.ppid() == warm.proc.pid, after_hang.ppid()
    third.wait(10)  # killed, not left stopped
    log = warm.log_path.read_text(errors="replace")
    assert log.count("engine template: cannot fork") == 2, warm.log_tail()


def test_a_shared_engine_template_forks_the_servers_engine_and_one_killed_costs_nothing(demo_model, tmp_path):
    """``--engine-template-socket``: the machine's templates (the suite's kind, a private host here)
    fork the server's engine: a child of the host's template of its environment, on the front's
    core, in the front's directory, its output in the front's log. That template SIGKILLed: the
    engine serves on.
    The engine then SIGKILLed: its end is seen (its code unknown), and the server, which does not
    ask a failed shared template again, forks the next engine from a template of its own."""
    shared = SharedEngineTemplate()
    extra = ("--engine-template-socket", shared.socket, *NO_SPARES, "--health-interval", "1", "--health-timeout", "4")
    try:
        with running(ServerProcess(demo_model, 1, tmp_path / "shared.log", extra_args=extra, cpus={1})) as srv:
            engine = psutil.Process(srv.engines()[0]["pid"])
            # The host's template of these engines' environment forked it.
            template = psutil.Process(engine.ppid())
            assert template.ppid() == shared.proc.pid and not templates_of(srv)
            assert engine.cpu_affinity() == [1] and engine.cwd() == psutil.Process(srv.proc.pid).cwd()
            completes(srv)
            log = srv.log_path.read_text(errors="replace")
            assert f"fork from the shared one at {shared.socket}" in log, srv.log_tail()
            assert f"[engine 0] (MainProcess pid={engine.pid})" in log, srv.log_tail()
            template.kill()
            template.wait(10)
            completes(srv)
            assert srv.engines()[0]["pid"] == engine.pid
            engine.kill()
            own = psutil.Process(back_up(srv, engine.pid)["pid"])
            (own_template,) = templates_of(srv)
            assert own.ppid() == own_template.pid
            completes(srv)
            log = srv.log_path.read_text(errors="replace")
            assert f"process {engine.pid} exited with an unknown code (its engine template is gone)" in log
            assert "this server starts its own" in log and "engine template: cannot fork" not in log, srv.log_tail()
    finally:
        shared.stop()


def test_without_spares_a_restart_starts_cold(servers):
    """``--warm-spares 0``: a restart starts a new process (no --standby), which serves; no spare follows."""
    cold = servers["cold"]
    before = cold.engines()[0]
    started = time.monotonic()
    r = httpx.post(f"{cold.url}/engines/0/restart", timeout=300)
    assert r.status_code == 200, r.text
    print(f"\nCOLD operator restart: answered {time.monotonic() - started:.1f}s after")
    engine = cold.engines()[0]
    assert engine["pid"] != before["pid"] and "--standby" not in psutil.Process(engine["pid"]).cmdline()
    completes(cold)
    time.sleep(2)
    assert cold.engines()[0]["spare"] is None and spares_of(cold) == []


def greedy(srv: ServerProcess) -> tuple[list[int], list[float]]:
    r = httpx.post(
        f"{srv.url}/v1/completions",
        json={"model": srv.model, "prompt": "the same", "max_tokens": 8, "temperature": 0, "logprobs": 1,
              "return_token_ids": True, "ignore_eos": True},
        timeout=120,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def test_an_engine_core_killed_under_load_takes_its_worker_with_it(servers):
    """An engine of one worker runs it inside its EngineCore (``devices.py``). SIGKILL of the
    EngineCore while the worker computes a long request: nothing of the engine's old processes
    lives on (no worker left computing on the core), and the cold engine that replaces it is again
    one EngineCore with its worker inside, on its core's one thread, serving the greedy tokens and
    logprobs the first served."""
    cold = servers["cold"]
    before = cold.engines()[0]
    core = vllm_process(before["pid"], "EngineCore")
    assert not core.children(), "a worker process under the EngineCore"
    reference = greedy(cold)
    old_tree = engine_tree(before["pid"])
    with httpx.Client(timeout=300) as http:
        long = {"model": cold.model, "prompt": "busy", "max_tokens": 3000, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(http.post, f"{cold.url}/v1/completions", json=long)
            computed = sum(core.cpu_times()[:2])
            # The request is being generated, by the worker inside the EngineCore: its CPU time
            # grows (slowly where the suite's other lanes hold the cores).
            deadline = time.monotonic() + 60
            while sum(core.cpu_times()[:2]) - computed < 0.5 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert sum(core.cpu_times()[:2]) - computed >= 0.5, "the EngineCore was not computing"
            assert not busy.done(), "the long request ended before the kill"
            core.send_signal(signal.SIGKILL)
            _, alive = psutil.wait_procs(old_tree, timeout=30)
            assert not alive, [(p.pid, _cmdline(p)) for p in alive]
            busy.result(timeout=300)
    engine = back_up(cold, before["pid"])
    new_core = vllm_process(engine["pid"], "EngineCore")
    assert not new_core.children(), "a worker process under the new EngineCore"
    # The engine's environment, which its EngineCore inherits (vLLM's process title overwrites the
    # EngineCore's own copy in /proc).
    environ = psutil.Process(engine["pid"]).environ()
    assert (environ.get(WORKER_PROCESSES_ENV), environ.get("OMP_NUM_THREADS")) == ("0", "1")
    assert greedy(cold) == reference


# Last: it stops the module's servers.
def test_stopping_the_service_stops_its_spares(servers):
    """SIGTERM: the front exits 0, and nothing it started, spares included, is left."""
    warm = servers["warm"]
    waiting_spare(warm)
    tree = psutil.Process(warm.proc.pid).children(recursive=True)
    assert any("--standby" in _cmdline(p) for p in tree)
    assert warm.stop() == 0
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, [(p.pid, _cmdline(p)) for p in alive]


def test_a_server_with_a_loaded_spare_leaves_none_of_its_segments_in_dev_shm(demo_model, tmp_path):
    """A server whose engine keeps vLLM's worker process (their message queues: segments in
    /dev/shm), with a loaded spare: stopped, it leaves none of the segments that the processes of
    its engine or of its spare mapped. (The spare is SIGKILLed with its process group, the
    resource tracker that would have removed them among it.) The module's servers run their worker
    inside the EngineCore: no segments."""
    # Its own engine template: its spare a process of the front's tree (spares_of).
    extra = ("--loaded-spares", "auto", "--engine-templates", "auto", "--health-interval", "1", "--health-timeout", "4")
    srv = ServerProcess(demo_model, 1, tmp_path / "segments.log", extra_args=extra, cpus={1}, env=WORKER_PROCESSES)
    with running(srv):
        spare = waiting_spare(srv)
        engine_pid = srv.engines()[0]["pid"]
        segments = {"engine": shm_segments(engine_tree(engine_pid)), "spare": shm_segments(engine_tree(spare.pid))}
        assert all(segments.values()), segments
        assert srv.stop() == 0
    assert {whose: left_in_shm(names) for whose, names in segments.items()} == {"engine": [], "spare": []}
