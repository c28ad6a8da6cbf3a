"""``GET /metrics``: the front's own metrics plus the engines' vLLM metrics.

The front counts requests by route, engine and status and times them; the
engine states, restarts and weight versions are read off the registry at
scrape time, so there is one source of truth for them. Each engine's own
metrics (vLLM's, from its process) are fetched live and re-labelled with
``engine="<id>"``, the label vLLM itself uses for an engine index; an engine that is
not up, or does not answer within the probe timeout, is left out of that scrape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import prometheus_client
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from ..fleet.registry import REGISTRY, EngineRegistry
from ..fleet.state import EngineState
from ..serving.proxy import ENGINE_HEADER, RELAYED_STREAM

log = logging.getLogger("skyinfer.metrics")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_PUSH_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# nginx's code for a client that went away before the answer.
CLIENT_CLOSED = 499
# The labels of skyinfer_weight_update_phase: the values of ``weights.phases.Phase``, idle first,
# named here so that the metrics need nothing of weights/ (which reports its steps to them).
UPDATE_PHASES = ("idle", "started", "staging", "receiving")


class _EngineCollector:
    """Engine state as the registry holds it, read at scrape time."""

    def __init__(self, registry: EngineRegistry):
        self.registry = registry

    def collect(self):
        state = GaugeMetricFamily(
            "skyinfer_engine_state", "1 for the state each engine is in", labels=["engine", "state"]
        )
        paused = GaugeMetricFamily(
            "skyinfer_engine_paused", "1 if the engine is paused (or sleeping)", labels=["engine"]
        )
        sleeping = GaugeMetricFamily("skyinfer_engine_sleeping", "1 if the engine is sleeping", labels=["engine"])
        in_flight = GaugeMetricFamily(
            "skyinfer_engine_in_flight", "requests the front holds for it: sent, or queued", labels=["engine"]
        )
        queued = GaugeMetricFamily(
            "skyinfer_engine_queued", "requests waiting in the front for a connection to it", labels=["engine"]
        )
        refused = CounterMetricFamily(
            "skyinfer_engine_queue_refusals", "requests answered 503 because its queue was full", labels=["engine"]
        )
        restarts = CounterMetricFamily("skyinfer_engine_restarts", "engine process replacements", labels=["engine"])
        version = GaugeMetricFamily(
            "skyinfer_engine_weight_version_info", "the weight version each engine serves", labels=["engine", "version"]
        )
        moves = CounterMetricFamily(
            "skyinfer_session_moves",
            "sessions moved off the engine at a request, it being far busier",
            labels=["engine"],
        )
        retried = CounterMetricFamily(
            "skyinfer_engine_requests_retried",
            "requests sent to another engine because this one died under them",
            labels=["engine"],
        )
        second_deaths = CounterMetricFamily(
            "skyinfer_engine_requests_ended_at_second_death",
            "requests in flight when this engine died that an engine had died under before: ended, not sent"
            " to a third (the log names each: request id, route, body hash)",
            labels=["engine"],
        )
        for r in self.registry.records:
            engine = str(r.engine_id)
            for s in EngineState:
                state.add_metric([engine, s.value], float(r.state is s))
            paused.add_metric([engine], float(r.paused))
            sleeping.add_metric([engine], float(r.vllm_is_sleeping))
            in_flight.add_metric([engine], r.in_flight_count)
            queued.add_metric([engine], r.queued)
            refused.add_metric([engine], r.refused)
            restarts.add_metric([engine], r.restarts)
            version.add_metric([engine, r.weight_version or ""], 1)
            moves.add_metric([engine], self.registry.router.moves.get(r.engine_id, 0))
            retried.add_metric([engine], r.retried_elsewhere)
            second_deaths.add_metric([engine], r.ended_at_second_death)
        return [state, paused, sleeping, in_flight, queued, refused, restarts, version, moves, retried, second_deaths]


class RequestMetrics:
    """Requests answered, by route, engine and status, and their latency: what every process that
    answers requests counts (the front, or each front worker and the control process)."""

    def __init__(self) -> None:
        self.prom = prometheus_client.CollectorRegistry()
        self.requests = prometheus_client.Counter(
            "skyinfer_requests", "HTTP requests answered", ["route", "engine", "status"], registry=self.prom
        )
        self.latency = prometheus_client.Histogram(
            "skyinfer_request_duration_seconds",
            "time to the end of the answer (streams included)",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.prom,
        )
        # Each series' child, kept: prometheus_client's labels() takes a lock and formats the labels
        # on every call, twice per request.
        self._answered: dict[tuple[str, str, int], Any] = {}
        self._durations: dict[str, Any] = {}

    def _count(self, route: str, engine: str, status: int, seconds: float) -> None:
        answered = self._answered.get((route, engine, status))
        if answered is None:
            answered = self._answered[route, engine, status] = self.requests.labels(route, engine, str(status))
        answered.inc()
        duration = self._durations.get(route)
        if duration is None:
            duration = self._durations[route] = self.latency.labels(route)
        duration.observe(seconds)

    def text(self) -> str:
        return prometheus_client.generate_latest(self.prom).decode()

    def middleware(self, counted: Callable[[web.Request], bool] = lambda _request: True):
        """``counted``: whether a request is this process's to count (a front worker passes the
        control process's routes on, and the control process counts those)."""

        @web.middleware
        async def count(request: web.Request, handler):
            if not counted(request):
                return await handler(request)
            started = time.perf_counter()
            status, engine = 500, ""
            try:
                response = await handler(request)
                status, engine = response.status, response.headers.get(ENGINE_HEADER, "")
                return response
            except web.HTTPException as exc:
                status = exc.status
                raise
            except asyncio.CancelledError:
                # The caller went away. A relayed stream's head went out before: its engine is known,
                # and if the caller had the whole answer (the openai SDK closes its connection on
                # reading [DONE], before the end of the chunked body) the request was answered.
                status = CLIENT_CLOSED
                if (relayed := request.get(RELAYED_STREAM)) is not None:
                    response, answer = relayed
                    engine = response.headers.get(ENGINE_HEADER, "")
                    if answer.delivered:
                        status = response.status
                raise
            finally:
                resource = request.match_info.route.resource
                # Unknown paths share one label: a scanner must not grow the series without bound.
                route = resource.canonical if resource is not None else "unmatched"
                self._count(route, engine, status, time.perf_counter() - started)

        return count


class ServiceMetrics(RequestMetrics):
    """The front's metrics: requests, weight pushes, and the engines' state read off the registry."""

    def __init__(self, registry: EngineRegistry):
        super().__init__()
        self.push_seconds = prometheus_client.Histogram(
            "skyinfer_weight_update_duration_seconds",
            "completed weight pushes, first transfer call to finish",
            buckets=_PUSH_BUCKETS,
            registry=self.prom,
        )
        self.push_failures = prometheus_client.Counter(
            "skyinfer_weight_update_failures", "weight pushes that failed on some engine", registry=self.prom
        )
        # A delta push moves fewer bytes than the tensors it updates: both, over the pushes finished.
        self.push_bytes = prometheus_client.Counter(
            "skyinfer_weight_update_bytes",
            "bytes of the weight pushes finished: sent (what moved) and dense (the tensors they updated, whole)",
            ["carried"],
            registry=self.prom,
        )
        self.update_phase = prometheus_client.Gauge(
            "skyinfer_weight_update_phase",
            "1 for the phase the fleet's weight update is in",
            ["phase"],
            registry=self.prom,
        )
        self._show_update_phase(UPDATE_PHASES[0])
        self.prom.register(_EngineCollector(registry))

    def set_update_phase(self, phase) -> None:
        """The phase machine's callback (``weights.phases.UpdateMachine``): the fleet's weight update
        is in ``phase``, a ``Phase`` whose value is its label."""
        self._show_update_phase(phase.value)

    def _show_update_phase(self, value: str) -> None:
        for known in UPDATE_PHASES:
            self.update_phase.labels(known).set(float(known == value))


METRICS = web.AppKey("metrics", ServiceMetrics)
# Set when front workers answer the data plane: asks each for its request metrics (Prometheus text).
WORKER_METRICS = web.AppKey("worker_metrics", Callable[[], Awaitable[list[str]]])


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families


def relabel_engine_metrics(texts: dict[int, str]) -> list[Metric]:
    """Merge engines' exposition texts into one family per metric, labelled by engine."""
    merged: dict[str, Metric] = {}
    for engine_id, text in texts.items():
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                target.add_sample(s.name, {**s.labels, "engine": str(engine_id)}, s.value, s.timestamp, s.exemplar)
    return list(merged.values())


async def _engine_metrics(engine_id: int, client: aiohttp.ClientSession, timeout_s: float) -> tuple[int, str | None]:
    try:
        async with client.get("/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return engine_id, (await resp.text()) if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        log.warning("engine %d: metrics unavailable: %r", engine_id, exc)
        return engine_id, None


HIT_RATE = "skyinfer_engine_prefix_cache_hit_rate"
# vLLM's counters of prompt tokens looked up in, and found in, an engine's prefix cache.
_PREFIX_QUERIES, _PREFIX_HITS = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"


def prefix_cache_hit_rates(engine_families: list[Metric]) -> GaugeMetricFamily:
    """Each engine's share of prompt tokens served from its prefix cache since it started, from vLLM's counters."""
    counts: dict[str, dict[str, float]] = {}
    for family in engine_families:
        if family.name in (_PREFIX_QUERIES, _PREFIX_HITS):
            for s in family.samples:
                if s.name.endswith("_total"):
                    per_engine = counts.setdefault(s.labels["engine"], {})
                    per_engine[family.name] = per_engine.get(family.name, 0.0) + s.value
    gauge = GaugeMetricFamily(
        HIT_RATE, "prompt tokens found in the engine's prefix cache / looked up", labels=["engine"]
    )
    for engine, count in sorted(counts.items()):
        if count.get(_PREFIX_QUERIES):
            gauge.add_metric([engine], count.get(_PREFIX_HITS, 0.0) / count[_PREFIX_QUERIES])
    return gauge


def read_hit_rates(metrics_text: str) -> dict[int, float]:
    """The hit-rate gauge out of a ``/metrics`` page: engine id -> rate."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == HIT_RATE:
            return {int(s.labels["engine"]): s.value for s in family.samples}
    return {}


def sum_expositions(texts: list[str]) -> list[Metric]:
    """Processes' exposition texts as one: samples with the same name and labels added up (a
    counter's ``_created``: the earliest)."""
    merged: dict[str, Metric] = {}
    values: dict[tuple, float] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                key = (family.name, s.name, tuple(sorted(s.labels.items())))
                if key not in values:
                    values[key] = s.value
                elif s.name.endswith("_created"):
                    values[key] = min(values[key], s.value)
                else:
                    values[key] += s.value
    for (family_name, name, labels), value in values.items():
        merged[family_name].add_sample(name, dict(labels), value)
    return list(merged.values())


def _render(metrics: ServiceMetrics, engine_texts: dict[int, str], worker_texts: list[str]) -> bytes:
    engine_families = relabel_engine_metrics(engine_texts)
    own = (
        prometheus_client.generate_latest(_Families(sum_expositions([metrics.text(), *worker_texts])))
        if worker_texts
        else prometheus_client.generate_latest(metrics.prom)
    )
    return own + prometheus_client.generate_latest(
        _Families([prefix_cache_hit_rates(engine_families), *engine_families])
    )


def metrics_view(probe_timeout_s: float):
    async def view(request: web.Request) -> web.Response:
        """Prometheus text: the front's own metrics and the vLLM metrics of each engine up that
        answers in time, labelled by engine."""
        records = [r for r in request.app[REGISTRY].up() if r.client is not None]
        fetched = await asyncio.gather(*(_engine_metrics(r.engine_id, r.client, probe_timeout_s) for r in records))
        texts = {engine_id: text for engine_id, text in fetched if text is not None}
        worker_metrics = request.app.get(WORKER_METRICS)
        worker_texts = await worker_metrics() if worker_metrics is not None else []
        # Parsing and rendering a few hundred samples per engine: off the event loop.
        body = await asyncio.to_thread(_render, request.app[METRICS], texts, worker_texts)
        return web.Response(body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})

    return view
