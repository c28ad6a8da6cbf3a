"""``/metrics`` parses as Prometheus text and moves with traffic."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx

from support import scrape, total


def test_metrics_parse_and_count_traffic(server, model_name):
    before = scrape(server)
    body = {"model": model_name, "prompt": "count me", "max_tokens": 5, "ignore_eos": True}
    served_by = set()
    for i in range(6):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-Session-ID": f"metrics-{i}"}, timeout=60)
        assert r.status_code == 200
        served_by.add(r.headers["X-Skyinfer-Engine"])
    assert (
        httpx.post(f"{server.url}/v1/completions", json={"model": model_name, "prompt": 1}, timeout=60).status_code
        == 400
    )
    assert httpx.get(f"{server.url}/no/such/route", timeout=10).status_code == 404
    after = scrape(server)

    def moved(family, sample, **labels) -> float:
        return total(after, family, sample, **labels) - total(before, family, sample, **labels)

    # The front's own counters, by route, engine and status.
    assert moved("skyinfer_requests", "skyinfer_requests_total", route="/v1/completions", status="200") == 6
    for engine in served_by:
        assert (
            moved("skyinfer_requests", "skyinfer_requests_total", route="/v1/completions", status="200", engine=engine)
            >= 1
        )
    assert moved("skyinfer_requests", "skyinfer_requests_total", route="/v1/completions", status="400") == 1
    assert moved("skyinfer_requests", "skyinfer_requests_total", route="unmatched", status="404") == 1
    latency = "skyinfer_request_duration_seconds"
    assert moved(latency, f"{latency}_count", route="/v1/completions") == 7
    assert moved(latency, f"{latency}_sum", route="/v1/completions") > 0
    # Engine state, read off the registry.
    for engine in ("0", "1"):
        assert total(after, "skyinfer_engine_state", "skyinfer_engine_state", engine=engine, state="ready") == 1
        assert total(after, "skyinfer_engine_state", "skyinfer_engine_state", engine=engine, state="dead") == 0
        assert total(after, "skyinfer_engine_paused", "skyinfer_engine_paused", engine=engine) == 0
    assert "skyinfer_engine_restarts" in after and "skyinfer_engine_weight_version_info" in after
    assert {s.labels["engine"] for s in after["skyinfer_session_moves"]} == {"0", "1"}
    assert "skyinfer_weight_update_duration_seconds" in after
    # Each engine's own vLLM metrics, labelled by engine: both engines finished requests.
    engines = {s.labels["engine"] for s in after["vllm:request_success"]}
    assert engines == {"0", "1"}
    assert sum(moved("vllm:request_success", "vllm:request_success_total", engine=e) for e in engines) == 6
    assert sum(moved("vllm:generation_tokens", "vllm:generation_tokens_total", engine=e) for e in engines) == 30


def test_prefix_cache_hit_rate_per_engine_in_metrics_and_status(server, model_name):
    prompt = "A long shared system prompt for every turn of the trajectory. " * 60
    body = {"model": model_name, "prompt": prompt, "max_tokens": 2}
    for _ in range(3):  # the same session, the same engine: the prompt's blocks are found from the second on
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-Session-ID": "prefix-hits"}, timeout=60)
        assert r.status_code == 200
    engine = r.headers["X-Skyinfer-Engine"]
    after = scrape(server)
    hits = total(after, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total", engine=engine)
    queries = total(after, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total", engine=engine)
    rate = total(after, "skyinfer_engine_prefix_cache_hit_rate", "skyinfer_engine_prefix_cache_hit_rate", engine=engine)
    assert hits > 0 and rate == hits / queries
    argv = [sys.executable, "-m", "skyinfer", "status", server.url]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    header, *rows = done.stdout.splitlines()
    cells = {row.split()[0]: row.split() for row in rows if row[:1].isdigit()}
    assert "PREFIX HITS" in header and f"{rate:.0%}" in cells[engine], done.stdout


DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json"
# What the operations guide promises the dashboard shows, by the metric that shows it.
DASHBOARD_MUST_SHOW = {
    "engine state": "skyinfer_engine_state", "requests in flight": "skyinfer_engine_in_flight",
    "requests queued": "skyinfer_engine_queued", "prefix-cache hit rate": "skyinfer_engine_prefix_cache_hit_rate",
    "weight version": "skyinfer_engine_weight_version_info", "update phase": "skyinfer_weight_update_phase",
    "restarts": "skyinfer_engine_restarts_total", "retries": "skyinfer_engine_requests_retried_total",
    "refusals": "skyinfer_engine_queue_refusals_total", "vLLM's own": "vllm:num_requests_running",
}  # fmt: skip


def test_the_grafana_dashboard_queries_only_metrics_the_server_exposes(server):
    dashboard = json.loads(DASHBOARD.read_text())
    exposed = {sample.name for samples in scrape(server).values() for sample in samples}
    queried: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names = set(re.findall(r"\b(?:skyinfer_[a-z_]+|vllm:[a-z_:]+)", target["expr"]))
            assert names, (panel["title"], target["expr"])
            queried |= names
    assert not queried - exposed, f"the dashboard queries metrics /metrics does not expose: {sorted(queried - exposed)}"
    assert not set(DASHBOARD_MUST_SHOW.values()) - queried, sorted(set(DASHBOARD_MUST_SHOW.values()) - queried)
