"""Stopping the server leaves no engine process behind."""

from __future__ import annotations

import signal

import psutil

from support import ServerProcess


def test_sigterm_stops_every_engine_process(demo_model, tmp_path):
    srv = ServerProcess(demo_model, engines=1, log_path=tmp_path / "server.log")
    try:
        srv.wait_ready()
        engine_pid = srv.engines()[0]["pid"]
        tree = psutil.Process(srv.proc.pid).children(recursive=True)
        pids = {p.pid for p in tree}
        # The engine child and vLLM's EngineCore beneath it, at least.
        assert engine_pid in pids
        assert any(p.ppid() == engine_pid for p in tree)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0, srv.log_tail()
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"
    finally:
        srv.stop()
