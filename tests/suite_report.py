"""What the suite cost, printed at its end: each module's time (its tests with their set-up and
tear-down, shared servers included where a module first asks for them) and the machine's peak
memory in use, with the module that was running then (docs/benchmarks-journal.rst keeps the figures).
With ``--cpu-report``, also the CPU seconds the suite's processes spent, by kind of process, in all
and per module: what to cut when the suite is to get faster on two cores."""

from __future__ import annotations

import collections
import threading
import time

import psutil
import pytest

__all__ = ("CpuByKind", "MemoryPeak", "Sampler")

SAMPLE_EVERY_S = 0.5
CPU_SAMPLE_EVERY_S = 2.0
# A process's kind, by what its command line says (vLLM names its processes once they run).
KINDS = (
    ("VLLM::EngineCore", "vLLM EngineCore"),
    ("VLLM::Worker", "vLLM worker"),
    ("VllmWorker", "vLLM worker"),
    ("spawn_main", STARTING := "vLLM EngineCore or worker, importing"),
    ("skyinfer.engine", "engine process (vLLM's API layer)"),
    ("skyinfer serve", "front"),
    ("skyinfer.front_workers", "front"),
    ("fake_engine", "fake engine"),
    ("tests/", "trainer or client process"),
    ("examples/", "trainer or client process"),
)


class Sampler:
    """Calls ``sample_once`` every ``every_s`` on a thread of its own, from ``start`` to ``stop``;
    ``running`` is the module whose tests run now."""

    every_s = SAMPLE_EVERY_S

    def __init__(self):
        self.running = "start-up"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=type(self).__name__, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.every_s)

    def sample_once(self) -> None:
        raise NotImplementedError


class MemoryPeak(Sampler):
    """The machine's memory in use (total less available) at its peak, and the module running then."""

    def __init__(self):
        super().__init__()
        self.peak_bytes = 0
        self.peak_during = "start-up"

    def sample_once(self) -> None:
        memory = psutil.virtual_memory()
        used = memory.total - memory.available
        if used > self.peak_bytes:
            self.peak_bytes, self.peak_during = used, self.running


def kind_of(process: psutil.Process) -> str:
    try:
        command = " ".join(process.cmdline())
    except psutil.Error:
        return "other"
    return next((kind for mark, kind in KINDS if mark in command), "other")


class CpuByKind(Sampler):
    """The CPU seconds of this process and everything beneath it, by kind of process and by the
    module running when they were spent (a process that lived less than a sample's interval is
    missed, the last interval of one that ended too)."""

    every_s = CPU_SAMPLE_EVERY_S

    def __init__(self):
        super().__init__()
        self.seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
        self._seen: dict[int, tuple[str, float]] = {}
        self._me = psutil.Process()

    def sample_once(self) -> None:
        for process in [self._me, *self._me.children(recursive=True)]:
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            spent = times.user + times.system
            kind, before = self._seen.get(process.pid) or ("", 0.0)
            if process is self._me:
                kind = "pytest"
            elif kind in ("", STARTING):  # vLLM names its processes once their imports are done
                kind = kind_of(process)
            self.seconds[self.running, kind] += max(0.0, spent - before)
            self._seen[process.pid] = (kind, max(spent, before))

    def lines(self) -> list[str]:
        by_kind: dict[str, float] = collections.Counter()
        by_module: dict[str, dict[str, float]] = collections.defaultdict(collections.Counter)
        for (module, kind), seconds in self.seconds.items():
            by_kind[kind] += seconds
            by_module[module][kind] += seconds
        total = sum(by_kind.values()) or 1.0
        out = [f"{seconds:8.0f} CPU-s {100 * seconds / total:5.1f}%  {kind}" for kind, seconds in by_kind.most_common()]
        for module, kinds in sorted(by_module.items(), key=lambda kv: -sum(kv[1].values())):
            parts = ", ".join(f"{kind} {seconds:.0f}" for kind, seconds in kinds.most_common(4))
            out.append(f"{sum(kinds.values()):8.0f} CPU-s  {module}: {parts}")
        return out


class SuiteReport:
    def __init__(self, cpu_report: bool):
        self.cpu = CpuByKind() if cpu_report else None
        self.memory = MemoryPeak()
        self.samplers: list[Sampler] = [self.memory, *([self.cpu] if self.cpu is not None else [])]
        self.module_seconds: dict[str, float] = collections.defaultdict(float)
        self.module_tests: dict[str, int] = collections.Counter()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        module = item.nodeid.split("::")[0]
        for sampler in self.samplers:
            sampler.running = module
        started = time.monotonic()
        yield
        self.module_seconds[module] += time.monotonic() - started
        self.module_tests[module] += 1

    def pytest_sessionstart(self, session) -> None:
        for sampler in self.samplers:
            sampler.start()

    def pytest_terminal_summary(self, terminalreporter) -> None:
        for sampler in self.samplers:
            sampler.stop()
        if self.cpu is not None:
            terminalreporter.section("CPU by kind of process (--cpu-report), in all and per module")
            for line in self.cpu.lines():
                terminalreporter.write_line(line)
        if not self.module_seconds:
            return
        write = terminalreporter.write_line
        terminalreporter.section("time per module (set-up and tear-down included)")
        for module, seconds in sorted(self.module_seconds.items(), key=lambda kv: -kv[1]):
            write(f"{seconds:8.1f} s  {self.module_tests[module]:4d} tests  {module}")
        write(f"{sum(self.module_seconds.values()):8.1f} s  in all")
        total_gib = psutil.virtual_memory().total / 2**30
        write(
            f"peak memory in use: {self.memory.peak_bytes / 2**30:.1f} GiB of {total_gib:.1f} GiB,"
            f" during {self.memory.peak_during}"
        )


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--cpu-report",
        action="store_true",
        help="print the CPU seconds the suite's processes spent, by kind of process, in all and per module",
    )


def pytest_configure(config) -> None:
    config.pluginmanager.register(SuiteReport(config.getoption("--cpu-report")), "suite-report")
