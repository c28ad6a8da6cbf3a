"""Helpers for tests that run real skyinfer servers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A `skyinfer serve` subprocess, as a user would start it."""

    def __init__(
        self,
        model: Path,
        engines: int,
        log_path: Path,
        extra_args: tuple[str, ...] = (),
        admin_key: str | None = None,
        cpus: set[int] | None = None,
    ):
        self.port = free_port()
        # What the tests' own status calls send; the server gets its keys through extra_args.
        self.admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "skyinfer", "serve", "--model", self.model, "--engines", str(engines),
             "--port", str(self.port), *extra_args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # Like `taskset -c`: the server plans its engines on the cores it may use.
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )  # fmt: skip

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready after {timeout_s}s:\n{self.log_tail()}")

    def engines(self) -> list[dict]:
        return httpx.get(f"{self.url}/engines", headers=self.admin_headers, timeout=10).json()["engines"]

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


def engine_of(response) -> int:
    """The engine that served a response, from skyinfer's response header."""
    return int(response.headers["X-Skyinfer-Engine"])


async def restore_fleet(http: httpx.AsyncClient) -> None:
    """Leave shared engines serving, whatever a test did to them."""
    if (await http.get("/is_sleeping")).json()["is_sleeping"]:
        assert (await http.post("/wake_up")).status_code == 200
    if (await http.get("/is_paused")).json()["is_paused"]:
        assert (await http.post("/resume")).status_code == 200


def scrape(server) -> dict[str, list]:
    r = httpx.get(f"{server.url}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    return {f.name: f.samples for f in text_string_to_metric_families(r.text)}


def total(families: dict, family: str, sample: str, **labels) -> float:
    return sum(
        s.value for s in families.get(family, []) if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )
