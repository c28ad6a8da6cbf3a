"""The front's side of warm restarts without a real engine: engine templates (shared ones that
answer of another environment, hang or serve late; a forked process signalled through its pidfd),
and the spares' supervisor over fake engines (tools/fake_engine.py stands by as the real engine
does): which spare takes over, a spare that dies, spares waiting for a steady fleet, and no spare
outliving the front however it ends. The real engines' warm restarts are test_warm_restarts'.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from fakes import FAKE_ENGINE, fake_fleet, kill, until

from skyinfer.config import ServeConfig
from skyinfer.engine.template import MAX_MESSAGE
from skyinfer.fleet.engine_templates import UNKNOWN_EXIT, EngineTemplates, ForkedProcess
from skyinfer.fleet.registry import REGISTRY
from skyinfer.fleet.spares import Spare
from skyinfer.fleet.supervisor import SUPERVISOR

from support import (
    ChildProcess,
    SharedEngineTemplate,
    free_port,
)

# A spare imports torch and vLLM on one busy core: it may take a while.
SPARE_TIMEOUT_S = 300


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:  # gone, or a zombie
        return []


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
