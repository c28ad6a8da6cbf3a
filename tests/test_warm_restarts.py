"""Warm restarts (``--warm-spares``, on by default): once the fleet is ready each engine has a spare
process that has imported torch and vLLM and waits; a restart, after a crash or on request, makes the
spare the engine's process instead of starting a cold one, and a new spare starts once the engine is
up. Real engines: a one-engine server with spares and one without, started together, each on a core
of its own. Then the supervisor's side over fake engines (tools/fake_engine.py stands by as the real
engine does): which spare takes over, a spare that dies, spares waiting for a steady fleet, and no
spare outliving the front however it ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from fakes import FAKE_ENGINE, fake_fleet, kill, until

from skyinfer.config import ServeConfig
from skyinfer.devices import WORKER_PROCESSES_ENV
from skyinfer.engine.template import MAX_MESSAGE
from skyinfer.fleet.engine_templates import UNKNOWN_EXIT, EngineTemplates, ForkedProcess
from skyinfer.fleet.registry import REGISTRY
from skyinfer.fleet.spares import Spare
from skyinfer.fleet.supervisor import SUPERVISOR

from support import (
    NO_SPARES,
    WORKER_PROCESSES,
    ChildProcess,
    ServerProcess,
    SharedEngineTemplate,
    engine_socket,
    engine_tree,
    free_port,
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


async def test_a_shared_template_of_other_engines_or_hung_is_not_asked_again(tmp_path, monkeypatch, caplog):
    """The front's side, against a socket that answers as a template would: one of another engine
    environment is refused, naming what differs; one that takes a fork order and never answers
    costs that engine its fork (it starts cold) after the probe timeout; neither is asked again
    by that server (its own template then, refused here: cold)."""
    path = str(tmp_path / "template.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen()
    listener.setblocking(False)
    connections: list[socket.socket] = []

    async def answer(theirs: dict) -> None:
        channel, _ = await asyncio.get_running_loop().sock_accept(listener)
        connections.append(channel)
        await asyncio.get_running_loop().sock_recv(channel, MAX_MESSAGE)
        await asyncio.get_running_loop().sock_sendall(channel, json.dumps({"ready": True, "env": theirs}).encode())

    caplog.set_level(logging.INFO, logger="skyinfer")
    env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    lifeline_read, lifeline_write = os.pipe()
    try:
        for theirs, why in (
            ({"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "1"}, "(OMP_NUM_THREADS differ)"),
            ({"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}, "fork order unanswered"),
        ):
            templates = EngineTemplates(start_timeout_s=10, answer_timeout_s=0.5, shared_socket=path)
            monkeypatch.setattr(templates, "_start", _no_own_template)
            started = time.monotonic()
            answering = asyncio.create_task(answer(theirs))
            caplog.clear()
            assert await templates.fork(["--help"], env, lifeline_read, [lifeline_read], None) is None
            await answering
            if why.startswith("("):
                assert f"is of another environment than these engines {why}" in caplog.text, caplog.text
            else:  # its one variable that may differ did: it forked for it, then hung
                assert "engine template: cannot fork" in caplog.text and time.monotonic() - started >= 0.5
            assert await templates.fork(["--help"], env, lifeline_read, [lifeline_read], None) is None
            with pytest.raises(BlockingIOError):  # nobody connected again
                listener.accept()
    finally:
        for channel in (*connections, listener):
            channel.close()
        os.close(lifeline_read)
        os.close(lifeline_write)


# The front's default (--engine-probe-timeout): how long a fork order, or a template done importing, may go unanswered.
PROBE_TIMEOUT_S = 5


async def _no_own_template(env, lifeline_fd):
    raise OSError("no template of its own in this test")


@pytest.fixture(scope="module")
def template_host():
    """A host of shared engine templates of its own (the suite's kind): its one template, of
    ``template_host.env``, is stopped here."""
    host = SharedEngineTemplate()
    yield host
    host.stop()


@pytest.fixture
def lifeline():
    """The read end of a lifeline pipe, for what a test forks from a template."""
    read, write = os.pipe()
    yield read
    os.close(read)
    os.close(write)


def running_process(p: psutil.Process) -> bool:
    return p.is_running() and p.status() != psutil.STATUS_ZOMBIE


async def host_template(host: SharedEngineTemplate, front: EngineTemplates, lifeline: int) -> psutil.Process:
    """The host's template, once ``front`` forked from it a process that exits at once."""
    forked = await front.fork(["--help"], host.env, lifeline, [lifeline], None)
    assert forked is not None and await forked.wait() == 0
    (template,) = psutil.Process(host.proc.pid).children()
    return template


async def test_a_fork_order_a_hung_shared_template_serves_late_starts_nothing(template_host, lifeline, tmp_path):
    """A shared template SIGSTOPped: the front gives up on a fork order after the probe timeout
    (that engine starts cold). Continued, the template serves the order late: its child, whose pid
    the front did not take, gets no go-ahead and ends before it runs the engine program (here a
    spare's, which would say on its report pipe that it stands by)."""
    front = EngineTemplates(SPARE_TIMEOUT_S, PROBE_TIMEOUT_S, template_host.socket)
    template = await host_template(template_host, front, lifeline)
    report_read, report_write = os.pipe()
    try:
        template.suspend()
        try:
            argv = ["--socket", str(tmp_path / "engine.sock"), "--lifeline-fd", str(lifeline)]
            argv += ["--standby", "--report-fd", str(report_write)]
            assert await front.fork(argv, template_host.env, lifeline, [lifeline, report_write], None) is None
        finally:
            template.resume()
        os.close(report_write)
        # End of file once the template, alive, took the order's descriptors and forked (which
        # closes its copies), and that child ended.
        said = await asyncio.get_running_loop().run_in_executor(None, os.read, report_read, MAX_MESSAGE)
        assert said == b"" and running_process(template), said
    finally:
        os.close(report_read)


async def test_a_hung_shared_template_costs_a_new_server_the_probe_timeout(
    template_host, lifeline, monkeypatch, caplog
):
    """The shared template, done importing, SIGSTOPped: a server that connects since is told by the
    host that its template is not importing, and drops it when it does not answer within the probe
    timeout, not the engine start timeout; it starts its own (refused here: cold)."""
    first = EngineTemplates(SPARE_TIMEOUT_S, PROBE_TIMEOUT_S, template_host.socket)
    template = await host_template(template_host, first, lifeline)
    caplog.set_level(logging.INFO, logger="skyinfer")
    # An engine start timeout the test would outlast, were it waited for.
    front = EngineTemplates(start_timeout_s=60, answer_timeout_s=PROBE_TIMEOUT_S, shared_socket=template_host.socket)
    monkeypatch.setattr(front, "_start", _no_own_template)
    template.suspend()
    try:
        assert await front.fork(["--help"], template_host.env, lifeline, [lifeline], None) is None
    finally:
        template.resume()
    reason = f"the shared one at {template_host.socket} did not answer within 5s; this server starts its own"
    assert reason in caplog.text, caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="a listener of another user: root starts it")
async def test_a_template_socket_of_another_user_is_not_sent_the_engines_environment(
    tmp_path, lifeline, monkeypatch, caplog
):
    """``--engine-template-socket`` where another user's process listens (``SO_PEERCRED``: who
    called listen()): the front sends it nothing (its engines' environment holds its keys and
    tokens), and starts its own template (refused here: cold)."""
    path = str(tmp_path / "template.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listening_read, listening = os.pipe()
    heard, heard_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setuid(65534)
            listener.listen()
            os.write(listening, b"l")
            channel, _ = listener.accept()
            os.write(heard_write, b"[" + channel.recv(MAX_MESSAGE) + b"]")
            code = 0
        finally:
            os._exit(code)
    os.close(listening)
    os.close(heard_write)
    try:
        assert os.read(listening_read, 1) == b"l"
        caplog.set_level(logging.INFO, logger="skyinfer")
        front = EngineTemplates(start_timeout_s=10, answer_timeout_s=PROBE_TIMEOUT_S, shared_socket=path)
        monkeypatch.setattr(front, "_start", _no_own_template)
        assert await front.fork(["--help"], {"HF_TOKEN": "secret"}, lifeline, [lifeline], None) is None
        assert os.read(heard, MAX_MESSAGE) == b"[]"  # the connection closed, nothing sent
        assert "is another user's (uid 65534)" in caplog.text, caplog.text
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        listener.close()
        for fd in (listening_read, heard):
            os.close(fd)


def _spare(forked: ForkedProcess) -> Spare:
    """A spare (an importing one's, that never stood by) of that process."""
    order_read, order_write = os.pipe()
    os.close(order_read)
    return Spare(0, forked, order_write, {}, loaded=False)


def _session_leader_with_pid(pid: int) -> subprocess.Popen:
    """A new process, leading a session of its own, given ``pid`` (free: its process reaped and its
    group gone) through ``ns_last_pid``; again while another fork takes it first."""
    for _ in range(50):
        with open("/proc/sys/kernel/ns_last_pid", "w") as last:
            last.write(str(pid - 1))
        proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    pytest.fail(f"pid {pid} went to other processes")


@pytest.mark.skipif(os.geteuid() != 0, reason="a pid given again on purpose: ns_last_pid is root's to write")
async def test_a_forked_process_is_signalled_through_its_pidfd_never_by_its_pid():
    """A template reaps what it forked at once; the front learns its code later. Signals go through
    the pidfd the front opened: to a process group after its leader is reaped (what it left), and,
    once the pid is another session leader's, to neither that one nor its group: not a signal,
    not a spare's kill. (The test's own children, reaped here, stand for the template's.)"""
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 600 & echo $!; exec sleep 600"], start_new_session=True, stdout=subprocess.PIPE
    )
    left = psutil.Process(int(leader.stdout.readline()))
    forked = ForkedProcess(leader.pid)
    forked.send_signal(signal.SIGTERM)
    assert leader.wait() == -signal.SIGTERM and forked.returncode is None
    _spare(forked).kill()
    await until(lambda: asyncio.sleep(0, not running_process(left)))
    assert await forked.wait() == UNKNOWN_EXIT

    gone = subprocess.Popen(["sleep", "600"], start_new_session=True)
    forked = ForkedProcess(gone.pid)
    gone.kill()
    gone.wait()
    stranger = _session_leader_with_pid(gone.pid)
    try:
        with pytest.raises(ProcessLookupError):
            forked.send_signal(signal.SIGKILL)
        _spare(forked).kill()
        stranger.terminate()
        assert stranger.wait() == -signal.SIGTERM  # not SIGKILLed before
    finally:
        stranger.kill()
        stranger.wait()
    assert await forked.wait() == UNKNOWN_EXIT


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


# -- the supervisor's side, over fake engines ----------------------------------------------------


async def spares_waiting(app) -> list[int]:
    """Each engine's spare's pid, once every engine has one standing by."""
    records = app[REGISTRY].records
    await until(lambda: asyncio.sleep(0, all(r.spare == "waiting" for r in records)))
    spares = app[SUPERVISOR].spares._spares
    return [spares[r.engine_id].proc.pid for r in records]


async def restart_engine_0_in_a_changed_environment(app) -> int:
    """Kill engine 0 while the front's environment holds a fake engine's script (one that fails
    ``/reset_mm_cache`` with 418), and wait until another process serves it; the old pid. A fake
    engine reads its script once it is set up: an importing spare's, at its start order."""
    records = app[REGISTRY].records
    os.environ["FAKE_ENGINE_SCRIPT"] = json.dumps({"fail": {"/reset_mm_cache": 418}})
    try:
        old = kill(app, 0)
        await until(lambda: asyncio.sleep(0, records[0].up and records[0].pid != old))
    finally:
        del os.environ["FAKE_ENGINE_SCRIPT"]
    return old


async def test_a_restart_takes_its_own_engines_spare(aiohttp_client, demo_model, tmp_path):
    """Engine 0's process is killed: engine 0's spare becomes it (engine 1's stays engine 1's), and
    engine 0 gets a new spare once it is up. An imports-only spare takes the environment a cold
    start would get now, not the one it was started with."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path, loaded_spares="off")
    records = app[REGISTRY].records
    spare_0, spare_1 = await spares_waiting(app)
    old = await restart_engine_0_in_a_changed_environment(app)
    assert records[0].pid == spare_0 and records[0].restarts == 1
    async with records[0].client.post("/reset_mm_cache") as answer:
        assert answer.status == 418
    async with records[1].client.post("/reset_mm_cache") as answer:
        assert answer.status == 200
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status == 200
    new_0, still_1 = await spares_waiting(app)
    assert new_0 not in (spare_0, old) and still_1 == spare_1


async def test_a_loaded_spare_cannot_take_a_changed_environment_and_a_cold_engine_starts(
    aiohttp_client, demo_model, tmp_path
):
    """A loaded spare (the default on CPU) built its engine with the environment it started with:
    when a cold start would now get another, the restart starts a cold engine with it, and the
    spare is let go; engine 1's spare, whose environment did not change, still takes over."""
    app, _client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    records = app[REGISTRY].records
    spare_0, spare_1 = await spares_waiting(app)
    assert "--loaded" in psutil.Process(spare_0).cmdline()
    old = await restart_engine_0_in_a_changed_environment(app)
    assert records[0].pid != spare_0 and "--standby" not in psutil.Process(records[0].pid).cmdline()
    async with records[0].client.post("/reset_mm_cache") as answer:
        assert answer.status == 418
    await until(
        lambda: asyncio.sleep(0, not psutil.pid_exists(spare_0) or psutil.Process(spare_0).status() == "zombie")
    )
    old = kill(app, 1)
    await until(lambda: asyncio.sleep(0, records[1].up and records[1].pid != old))
    assert records[1].pid == spare_1


async def test_a_spare_that_dies_leaves_a_cold_restart_then_comes_back(aiohttp_client, demo_model, tmp_path):
    """A spare killed while it waits: its slot shows none, the engine's next restart starts cold
    (not a spare's pid), and once it is up the slot has a spare again."""
    app, _client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    records = app[REGISTRY].records
    spare_0, _ = await spares_waiting(app)
    os.killpg(spare_0, signal.SIGKILL)
    await until(lambda: asyncio.sleep(0, records[0].spare is None))
    old = kill(app, 0)
    await until(lambda: asyncio.sleep(0, records[0].up and records[0].pid != old))
    assert records[0].pid != spare_0
    assert "--standby" not in psutil.Process(records[0].pid).cmdline()
    new_0, _ = await spares_waiting(app)
    assert new_0 not in (spare_0, records[0].pid)


async def test_spares_start_only_while_the_fleet_is_steady(aiohttp_client, demo_model, tmp_path):
    """Engine 1 restarts into a paused fleet and takes 4 s to pause; engine 0, restarted meanwhile,
    is up at once, but gets its new spare only once engine 1 is up too."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    records = app[REGISTRY].records
    await spares_waiting(app)
    assert (await client.post("/pause", params={"mode": "keep"})).status == 200
    os.environ["FAKE_ENGINE_SCRIPT"] = json.dumps({"delay_s": {"/pause": 4}})
    try:
        old_1 = kill(app, 1)
        await until(lambda: asyncio.sleep(0, records[1].pid != old_1))
    finally:
        del os.environ["FAKE_ENGINE_SCRIPT"]
    old_0 = kill(app, 0)
    await until(lambda: asyncio.sleep(0, records[0].up and records[0].pid != old_0))
    assert not records[1].up
    while not records[1].up:
        assert records[0].spare is None and records[1].spare is None
        await asyncio.sleep(0.05)
    await spares_waiting(app)
    assert (await client.post("/resume")).status == 200


async def test_with_spares_off_no_spare_starts(aiohttp_client, demo_model, tmp_path):
    app, _client = await fake_fleet(aiohttp_client, demo_model, tmp_path, warm_spares=0)
    records = app[REGISTRY].records
    old = kill(app, 0)
    await until(lambda: asyncio.sleep(0, records[0].up and records[0].pid != old))
    await asyncio.sleep(1)
    assert [r.spare for r in records] == [None, None] and app[SUPERVISOR].spares._spares == {}
    assert not [p for p in psutil.Process().children() if "--standby" in _cmdline(p)]


async def test_the_app_stopping_kills_its_spares(aiohttp_client, demo_model, tmp_path):
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    pids = await spares_waiting(app)
    spares = [psutil.Process(pid) for pid in pids]
    await client.close()
    _, alive = psutil.wait_procs(spares, timeout=10)
    assert not alive


_FAKE_FRONT = """
import asyncio, sys
from skyinfer.config import ServeConfig
from skyinfer.front.service import run_service
config = ServeConfig(model=sys.argv[1], port=int(sys.argv[2]), engines=2, device="cpu",
                     engine_command=(sys.executable, sys.argv[3]))
sys.exit(asyncio.run(run_service(config)))
"""


def test_a_sigkilled_front_takes_its_spares_with_it(demo_model, tmp_path):
    """However the front dies, its spares' lifeline ends: they go with it, their relays too."""
    port = free_port()
    argv = [sys.executable, "-c", _FAKE_FRONT, str(demo_model), str(port), FAKE_ENGINE]
    front = ChildProcess(argv, tmp_path / "front.log", port)
    try:
        front.wait_ready(timeout_s=60)
        deadline = time.monotonic() + 60
        while [e["spare"] for e in httpx.get(f"{front.url}/engines", timeout=10).json()["engines"]] != ["waiting"] * 2:
            assert time.monotonic() < deadline, front.log_tail()
            time.sleep(0.1)
        tree = psutil.Process(front.proc.pid).children(recursive=True)
        assert len([p for p in tree if "--standby" in _cmdline(p)]) == 2
        front.proc.kill()
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive, [(p.pid, _cmdline(p)) for p in alive]
    finally:
        front.stop()


def test_warm_spares_is_zero_or_one():
    assert ServeConfig(model="m").warm_spares == 1
    assert ServeConfig(model="m", warm_spares=0).warm_spares == 0
    with pytest.raises(ValueError):
        ServeConfig(model="m", warm_spares=2)
