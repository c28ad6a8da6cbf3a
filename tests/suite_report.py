"""What the suite cost, printed at its end: each module's time (its tests with their set-up and
tear-down, shared servers included where a module first asks for them) and the machine's peak
memory in use, with the module that was running then (docs/benchmarks.rst keeps the figures)."""

from __future__ import annotations

import collections
import threading
import time

import psutil
import pytest

__all__ = ("MemoryPeak",)

SAMPLE_EVERY_S = 0.5


class MemoryPeak:
    """Samples the machine's memory in use (total less available) on a thread of its own."""

    def __init__(self):
        self.peak_bytes = 0
        self.peak_during = "start-up"
        self.running = "start-up"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="memory-peak", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            memory = psutil.virtual_memory()
            used = memory.total - memory.available
            if used > self.peak_bytes:
                self.peak_bytes, self.peak_during = used, self.running
            self._stop.wait(SAMPLE_EVERY_S)


class SuiteReport:
    def __init__(self):
        self.memory = MemoryPeak()
        self.module_seconds: dict[str, float] = collections.defaultdict(float)
        self.module_tests: dict[str, int] = collections.Counter()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        module = item.nodeid.split("::")[0]
        self.memory.running = module
        started = time.monotonic()
        yield
        self.module_seconds[module] += time.monotonic() - started
        self.module_tests[module] += 1

    def pytest_sessionstart(self, session) -> None:
        self.memory.start()

    def pytest_terminal_summary(self, terminalreporter) -> None:
        self.memory.stop()
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


def pytest_configure(config) -> None:
    config.pluginmanager.register(SuiteReport(), "suite-report")
