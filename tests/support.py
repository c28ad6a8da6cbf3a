"""Helpers for tests that run real skyinfer servers."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from skyinfer.config import ServeConfig
from skyinfer.devices import WORKER_PROCESSES_ENV
from skyinfer.front.app import create_app

START_TIMEOUT_S = 300
# A trainer in a process of its own (torch and skyinfer.trainer only).
TRAINER = Path(__file__).with_name("trainer_process.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# pytest's own, which differ from test to test: a server's engines whose environment differs from
# the shared engine template's fork from a template of their own (SharedEngineTemplate).
_PYTEST_VARIABLES = frozenset({"PYTEST_CURRENT_TEST", "COLUMNS", "LINES"})


def _child_environment() -> dict[str, str]:
    return {
        **{name: value for name, value in os.environ.items() if name not in _PYTEST_VARIABLES},
        # vLLM keeps Responses API answers (for GET /v1/responses/{id}) only when told to: the
        # shared server's tests read them; every server has it, for one engine environment.
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
    }


class ChildProcess:
    """A service started as a subprocess (port picked here, output to a log file)."""

    # Answers 200 once the service can take requests.
    ready_path = "/ready"

    def __init__(self, argv: list[str], log_path: Path, port: int, preexec_fn=None, env: dict | None = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (the child writes it for its whole life; stop() closes it)
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
            env={**_child_environment(), **(env or {})},
        )

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[0]} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}{self.ready_path}", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"not ready after {timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


# False in the lane of the modules that start no vLLM engine (``--lane front``, tests/server_plan.py).
REAL_SERVERS_ALLOWED = True


class SharedEngineTemplate:
    """The pytest's engine templates (``--engine-template-socket``: a host, which starts one per
    engine environment): its servers fork their CPU engines from them instead of each starting a
    template of its own, which imports torch and vLLM again (about 9 CPU-seconds; some 25 servers
    a run), but those that pass ``--engine-templates``. They live as long as this process holds
    their lifeline."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="skyinfer-suite-template-"))  # the user's alone
        self.socket = str(self.directory / "template.sock")
        # The variables the interpreter reads at its start as the engines' (devices.py sets this one):
        # the host serves the fronts whose engines' are its own.
        self.env = {**_child_environment(), "PYTHONUNBUFFERED": "1"}
        lifeline, self._lifeline = os.pipe()
        self._log = open(self.directory / "template.log", "wb")  # noqa: SIM115 (stop() closes it)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "skyinfer.engine.template", "--listen", self.socket, "--lifeline-fd", str(lifeline)],
            pass_fds=(lifeline,),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        os.close(lifeline)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the suite's engine template did not listen: {self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self) -> str:
        self._log.flush()
        return (self.directory / "template.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        os.close(self._lifeline)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        shutil.rmtree(self.directory, ignore_errors=True)


_shared_template: SharedEngineTemplate | None = None
_shared_template_lock = threading.Lock()


def shared_engine_template() -> str:
    """The socket of the pytest's engine template, started on first use (again if it died)."""
    global _shared_template
    with _shared_template_lock:
        if _shared_template is None or _shared_template.proc.poll() is not None:
            _shared_template = SharedEngineTemplate()
        return _shared_template.socket


def stop_shared_engine_template() -> None:
    global _shared_template
    with _shared_template_lock:
        if _shared_template is not None:
            _shared_template.stop()
            _shared_template = None


# The suite's engines' KV cache: 128K tokens of the demo model in float32 (2 layers, one KV head of
# 64), far more than any test holds at once; the default (--cpu-kvcache-gib 1) would take 0.9 GiB
# more per engine (1.7 GiB instead of 0.8 for an engine of the demo model with its EngineCore).
SUITE_KV_CACHE_BYTES = 128 * 2**20


class ServerProcess(ChildProcess):
    """A `skyinfer serve` subprocess, as a user would start it."""

    def __init__(
        self,
        model: Path,
        engines: int,
        log_path: Path,
        extra_args: tuple[str, ...] = (),
        admin_key: str | None = None,
        cpus: set[int] | None = None,
        port: int | None = None,
        env: dict | None = None,
    ):
        if not REAL_SERVERS_ALLOWED:
            raise RuntimeError("a module of the front-only lane starts vLLM engines: take it out of FRONT_ONLY")
        port = port or free_port()
        self.model = str(model)
        # What the tests' own status calls send; the server gets its keys through extra_args.
        self.admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        argv = [
            sys.executable,
            "-m",
            "skyinfer",
            "serve",
            "--model",
            self.model,
            "--engines",
            str(engines),
            "--port",
            str(port),
            # A loaded spare (the default on CPU) holds a whole engine and takes a core for 20 s to
            # build: the suite's servers have imports-only spares, test_warm_restarts the default.
            *(() if "--loaded-spares" in extra_args else ("--loaded-spares", "off")),
            *(
                ()
                if "--kv-cache-memory-bytes" in extra_args
                else ("--kv-cache-memory-bytes", str(SUITE_KV_CACHE_BYTES))
            ),
            *(
                ()
                if "--engine-templates" in extra_args or "--engine-template-socket" in extra_args
                else ("--engine-template-socket", shared_engine_template())
            ),
            *extra_args,
        ]
        # Like `taskset -c`: the server plans its engines on the cores it may use.
        super().__init__(
            argv, log_path, port, preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None, env=env
        )

    def engines(self) -> list[dict]:
        return httpx.get(f"{self.url}/engines", headers=self.admin_headers, timeout=60).json()["engines"]

    def shm_files(self, *kinds: str) -> list[str]:
        """Its files in /dev/shm, of ``kinds`` (``pushes``, ``catch_up``; all by default), by the
        prefixes ``/weight_info`` names: the suite's other lanes' servers make theirs meanwhile."""
        info = httpx.get(f"{self.url}/weight_info", headers=self.admin_headers, timeout=60).json()
        prefixes = tuple(p for kind, p in info["shm_prefixes"].items() if p and (not kinds or kind in kinds))
        return [path for path in glob.glob("/dev/shm/skyinfer-*") if os.path.basename(path).startswith(prefixes)]


# TRL's get_sequence_logprobs asks for the top 100 of every prompt token (vLLM's default cap: 20).
MAX_LOGPROBS = 100
# The session's servers live as long as it: a warm spare per engine would hold 0.6 GiB throughout
# (test_warm_restarts' and the fault modules' own servers have theirs, the default).
NO_SPARES = ("--warm-spares", "0")
# A server's environment for engines of one worker that keep vLLM's worker process (skyinfer runs
# the worker inside the EngineCore unless the front's environment says otherwise: devices.py): its
# message queues in /dev/shm are what the fault and shutdown tests check are not left behind.
WORKER_PROCESSES = {WORKER_PROCESSES_ENV: "1"}


def two_float32_engines(model: Path, log_path: Path, *more_args: str) -> ServerProcess:
    """The shared server's kind: two engines in float32, so that greedy tokens
    compared across batch shapes do not flip on bf16 rounding."""
    return ServerProcess(
        model,
        engines=2,
        log_path=log_path,
        extra_args=(
            *more_args,
            "--allow-collective-rpc",
            COLLECTIVE_RPC_ALLOWED,
            "--dtype",
            "float32",
            # Faults that leave no engine serving are answered 503 after a second's hold.
            "--hold-requests",
            "1",
            # What clients' features need of vLLM: tool_choice="auto" (the openai SDK, agent
            # harnesses) and TRL's default prompt_logprobs=100.
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--max-logprobs",
            str(MAX_LOGPROBS),
            *NO_SPARES,
        ),
    )


# The one worker method the shared server lets /collective_rpc run: a harmless getter of skyinfer's.
COLLECTIVE_RPC_ALLOWED = "skyinfer_transfer_status"


API_KEY = "sk-data-test-0123456789"
ADMIN_KEY = "sk-admin-test-9876543210"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def keyed_one_engine(model: Path, log_path: Path, *more_args: str) -> ServerProcess:
    """One engine behind keys and a 1 MiB body limit: the security tests' server, and the
    load tests' (every one of their requests passes the key check)."""
    return ServerProcess(
        model,
        engines=1,
        log_path=log_path,
        admin_key=ADMIN_KEY,
        extra_args=("--api-key", API_KEY, "--admin-key", ADMIN_KEY, "--max-request-mb", "1", *NO_SPARES, *more_args),
    )


# The two ways the front runs, as test ids: one process, or a control process and two front
# workers. The data-plane, session, retry, pause and load modules run both ways.
ONE_FRONT, FRONT_WORKERS = "one-front", "front-workers"
FRONTS = (ONE_FRONT, FRONT_WORKERS)
WORKERS_ARGS = ("--front-workers", "2")


def both_fronts(one_front: str, front_workers: str):
    """A module's server fixture run both ways: the tests of the module run against the session's
    server named ``one_front``, then against its twin behind front workers, ``front_workers``."""

    @pytest.fixture(scope="module", params=FRONTS)
    def server(request) -> ServerProcess:
        srv = request.getfixturevalue(one_front if request.param == ONE_FRONT else front_workers)
        srv.wait_ready()
        return srv

    return server


def launched(srv: ChildProcess):
    """For fixtures: a server launched (ready or not), stopped at the end."""
    try:
        yield srv
    finally:
        srv.stop()


# What a module's own servers are launched from (``module_servers``), by module name; and those
# launched ahead of their module (tests/server_plan.py), waiting for it.
LAUNCHERS: dict[str, Callable[[Path, Path], Any]] = {}
PRESTARTED: dict[str, Any] = {}


def _children(launched) -> list[ChildProcess]:
    if isinstance(launched, dict):
        return list(launched.values())
    return list(launched) if isinstance(launched, (tuple, list)) else [launched]


def module_servers(module: str, launch: Callable[[Path, Path], Any]):
    """A module's own servers as a module-scoped fixture: ``launch(demo_model, log_dir)`` starts
    them (a server, or a tuple or dict of them); they are ready before the module's first test and
    stopped after its last. The suite launches them while the module before runs
    (tests/server_plan.py), so that their start-up overlaps it."""
    LAUNCHERS[module] = launch

    @pytest.fixture(scope="module")
    def servers(demo_model, tmp_path_factory):
        launched = PRESTARTED.pop(module, None) or launch(demo_model, tmp_path_factory.mktemp(module))
        with running(*_children(launched)):
            yield launched

    return servers


def stop_all(launched) -> None:
    for child in _children(launched):
        child.stop()


@contextlib.contextmanager
def running(*children: ChildProcess):
    """For fixtures: the children, ready; stopped afterwards however the tests went.

    Children start when constructed, so several given here start together: an
    engine starts one process after another, so two one-engine servers on two
    cores are ready in about the time of one.
    """
    try:
        for child in children:
            child.wait_ready()
        yield children[0] if len(children) == 1 else children
    finally:
        for child in children:
            child.stop()


def process_tree(srv: ServerProcess) -> list[psutil.Process]:
    """Every process under a server, checked to hold engine 0 and vLLM's EngineCore beneath it."""
    tree = psutil.Process(srv.proc.pid).children(recursive=True)
    engine_pid = srv.engines()[0]["pid"]
    # The engine child and vLLM's EngineCore beneath it, at least.
    assert engine_pid in {p.pid for p in tree} and any(p.ppid() == engine_pid for p in tree)
    return tree


def until_engine(server: ServerProcess, predicate, timeout_s: float = 240) -> dict:
    """A one-engine server's engine once ``predicate`` holds for it (``/engines``), polled."""
    deadline = time.monotonic() + timeout_s
    while not predicate(engine := server.engines()[0]):
        assert time.monotonic() < deadline, engine
        time.sleep(0.5)
    return engine


def killed_until_stale(server: ServerProcess, victim: psutil.Process, what: str) -> dict:
    """SIGKILL ``victim`` (a process of a one-engine server's engine); the engine once it is back,
    stale (the pushed weights went with the old one), saying it restarted."""
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    engine = until_engine(server, lambda e: e["restarts"] == 1 and e["state"] == "stale")
    print(f"{what}: engine back (stale) {time.monotonic() - killed_at:.1f}s after the SIGKILL")
    assert "restarted" in engine["stale_reason"], engine
    return engine


def vllm_process(engine_pid: int, role: str) -> psutil.Process:
    """vLLM's EngineCore or worker process under one engine."""
    (proc,) = [p for p in psutil.Process(engine_pid).children(recursive=True) if role in " ".join(p.cmdline())]
    return proc


def worker_processes(engine_core: psutil.Process) -> list[psutil.Process]:
    """vLLM's worker processes under an EngineCore, in rank order. Its only other child may be
    multiprocessing's resource tracker, which the EngineCore (forked from its engine process, not
    spawned) starts when it starts its workers."""
    children = engine_core.children()
    workers = sorted((p for p in children if p.name().startswith("VLLM::Worker")), key=lambda p: p.name())
    others = [" ".join(p.cmdline()) for p in children if p not in workers]
    assert all("multiprocessing.resource_tracker" in cmdline for cmdline in others), others
    return workers


def engine_tree(engine_pid: int) -> list[psutil.Process]:
    """An engine's process and every process beneath it (vLLM's EngineCore, workers)."""
    engine = psutil.Process(engine_pid)
    return [engine, *engine.children(recursive=True)]


def shm_segments(procs: list[psutil.Process]) -> set[str]:
    """vLLM's segments in /dev/shm (``psm_*``: its message queues between EngineCore and its
    workers) that these processes map, read from their /proc/<pid>/maps while they run."""
    names: set[str] = set()
    for proc in procs:
        with contextlib.suppress(OSError):
            names |= set(re.findall(r"/dev/shm/(psm_\w+)$", Path(f"/proc/{proc.pid}/maps").read_text(), re.M))
    return names


def mapped_files(procs: list[psutil.Process], prefix: str) -> set[str]:
    """The files in /dev/shm whose names begin with ``prefix`` that these processes map (a removed
    one still mapped too: its pages live on as long as a mapping does)."""
    names: set[str] = set()
    for proc in procs:
        with contextlib.suppress(OSError):
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
            names |= set(re.findall(rf"/dev/shm/({re.escape(prefix)}\w*)(?: \(deleted\))?$", maps, re.M))
    return names


def left_in_shm(segments: set[str]) -> list[str]:
    """Those of ``segments`` still in /dev/shm."""
    return sorted(name for name in segments if os.path.exists(f"/dev/shm/{name}"))


def engine_socket(srv: ServerProcess, engine: int) -> str:
    """The Unix socket an engine serves on, from its command line: for reaching one engine
    behind the front's back."""
    argv = psutil.Process(srv.engines()[engine]["pid"]).cmdline()
    return argv[argv.index("--socket") + 1]


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """One of examples/ run as a user runs it; it must exit 0."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def is_openai_error(r: httpx.Response) -> bool:
    return is_openai_error_body(r.status_code, r.url.path, r.content)


def is_openai_error_body(status: int, path: str, body: bytes) -> bool:
    """An answer's body in the OpenAI error shape (``is_openai_error`` for clients other than httpx)."""
    try:
        answer = json.loads(body)
        err = answer["error"]
    except (ValueError, KeyError, TypeError):
        return False
    if path.startswith("/v1/messages") and answer.get("type") == "error":
        # vLLM's Anthropic routes answer their own refusals in Anthropic's error shape, which its SDK
        # reads (a body that fails validation gets the OpenAI shape, as from vLLM's own server).
        return isinstance(err, dict) and isinstance(err.get("message"), str)
    # The code is the status, or a string naming what a client can do (TRANSFER_GROUP_GONE).
    code = err.get("code") if isinstance(err, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and (code == status or isinstance(code, str))


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """A streamed answer's lines, split at "\\n" only. httpx's ``aiter_lines`` also splits at U+0085,
    U+2028 and the like, which JSON carries unescaped inside a token's text: a random model's
    answer has them now and then, and the event comes out cut in two."""
    buffer = ""
    async for text in response.aiter_text():
        *lines, buffer = (buffer + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if buffer:
        yield buffer


def engine_of(response) -> int:
    """The engine that served a response, from skyinfer's response header."""
    return int(response.headers["X-Skyinfer-Engine"])


async def restore_fleet(http: httpx.AsyncClient) -> None:
    """Leave shared engines serving, whatever a test did to them."""
    if (await http.get("/is_sleeping")).json()["is_sleeping"]:
        assert (await http.post("/wake_up")).status_code == 200
    if (await http.get("/is_paused")).json()["is_paused"]:
        assert (await http.post("/resume")).status_code == 200


def restore_checkpoint(server: ServerProcess) -> None:
    """Leave a shared server as it started, after tests that pushed weights into it: every
    engine up and serving the checkpoint again (loaded from disk in place, under the label an
    engine gives the weights it loaded), out of any transfer group."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not all(e["state"] in ("ready", "paused", "sleeping", "stale") for e in server.engines()):
        assert time.monotonic() < deadline, server.engines()
        time.sleep(0.5)

    async def serving() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            await restore_fleet(http)

    asyncio.run(serving())
    r = httpx.post(f"{server.url}/reload_weights", timeout=300)
    assert r.status_code == 200 and r.json()["weight_version"] == "default", r.text
    assert httpx.post(f"{server.url}/shutdown_weight_transfer_engine", timeout=60).status_code == 200
    assert [e["state"] for e in server.engines()] == ["ready"] * len(server.engines())


def scrape(server) -> dict[str, list]:
    r = httpx.get(f"{server.url}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    return {f.name: f.samples for f in text_string_to_metric_families(r.text)}


def total(families: dict, family: str, sample: str, **labels) -> float:
    return sum(
        s.value
        for s in families.get(family, [])
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def total_unfinished(http: httpx.AsyncClient) -> int:
    return sum(e["unfinished_requests"] or 0 for e in (await http.get("/engines")).json()["engines"])


async def wait_unfinished(http: httpx.AsyncClient, n: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := await total_unfinished(http)) != n:
        assert time.monotonic() < deadline, f"expected {n} unfinished requests, have {got}"
        await asyncio.sleep(0.05)


async def admit_while_paused(http: httpx.AsyncClient, coros, already_in_flight: int = 0) -> list[asyncio.Task]:
    """Start requests while the engines are paused (keep), so all are in flight at once.

    The demo model decodes a batch so fast that requests started on a running
    engine may finish before anyone can pause them. Returns with engines paused.
    """
    assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
    tasks = [asyncio.create_task(c) for c in coros]
    await wait_unfinished(http, already_in_flight + len(tasks))
    return tasks


def concrete(path: str) -> str:
    """A route's path with its variable parts filled in (``/v1/responses/{response_id}``; an engine
    that does not exist, so that nothing restarts)."""
    return path.replace("{response_id}", "resp_test").replace("{engine_id}", "99")


def app_routes(model, socket_dir) -> set[tuple[str, str]]:
    """Every (method, path) the front serves, read off the app itself (no engine starts)."""
    app = create_app(ServeConfig(model=str(model), device="cpu", socket_dir=str(socket_dir)))
    return {(r.method, r.resource.canonical) for r in app.router.routes() if r.method in ("GET", "POST")}
