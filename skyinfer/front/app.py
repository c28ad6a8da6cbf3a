"""The front: ``create_app(config)`` builds the aiohttp application."""

from __future__ import annotations

import os
import shutil
import tempfile

from aiohttp import web

from ..admin.control import CONTROL, ControlPlane, add_control_routes
from ..admin.health import engines_view, health, ready
from ..admin.metrics import METRICS, WORKER_METRICS, ServiceMetrics, metrics_view
from ..admin.security import DATA_PLANE_PATHS, AccessPolicy
from ..admin.vllm_routes import add_vllm_routes
from ..config import ServeConfig
from ..devices import detect_device_kind, given, plan_engine_devices
from ..errors import openai_errors_middleware
from ..fleet.registry import REGISTRY, EngineRegistry
from ..fleet.routing import SessionRouter
from ..fleet.state import EngineRecord
from ..fleet.supervisor import SUPERVISOR, Supervisor, add_supervisor_routes
from ..front_workers.leases import LeaseHub
from ..front_workers.pool import FRONT_WORKERS, FrontWorkers
from ..ranks import LayoutError
from ..serving import abandoning
from ..serving.draining import IN_FLIGHT, InFlight
from ..serving.leasing import LocalLeases
from ..serving.proxy import GROUP_PREFIX_CHARS, LEASES, add_data_plane_routes
from ..serving.sessions import FINISH_SESSION_PATH, finish_session
from ..transfer import transport_for
from ..weights.adapters import ADAPTERS, AdapterFleet, add_adapter_routes
from ..weights.catchup import CATCH_UP, CatchUp, add_catch_up_routes
from ..weights.routes import add_weight_routes
from ..weights.sync import WEIGHT_SYNC, WeightSync
from ..weights.transports import FrontTransport
from .bringup import Bringup
from .cpu_support import Cpu, refuse_what_this_cpu_cannot_run


def build_registry(config: ServeConfig, kind: str, socket_dir: str) -> EngineRegistry:
    if kind == "cpu":
        refuse_what_this_cpu_cannot_run(config, Cpu.this_machine())
    # vLLM's own option, when given, sizes the KV cache (to the byte: --cpu-kvcache-gib is whole GiB).
    kvcache_gib = None if given("--kv-cache-memory-bytes", config.engine_args) else config.cpu_kvcache_gib
    plans = plan_engine_devices(kind, config.workers_per_engine, kvcache_gib)
    records = [
        EngineRecord(
            engine_id=i,
            devices=plan,
            socket_path=os.path.join(socket_dir, f"engine-{i}.sock"),
            connection_limit=config.engine_connections,
            queue_limit=config.engine_queue_limit,
            parallel=parallel,
        )
        for i, (plan, parallel) in enumerate(zip(plans, config.engine_parallel, strict=True))
    ]
    router = SessionRouter(
        config.max_sessions,
        config.session_idle_ttl_s,
        config.session_rebalance_factor,
        config.group_prefix_chars,
        config.group_slack,
    )
    return EngineRegistry(records, router, config.hold_requests_s)


def create_app(config: ServeConfig) -> web.Application:
    socket_dir = config.socket_dir or tempfile.mkdtemp(prefix="skyinfer-")
    kind = detect_device_kind() if config.device == "auto" else config.device
    registry = build_registry(config, kind, socket_dir)
    metrics = ServiceMetrics(registry)
    access = AccessPolicy(config.api_key, config.admin_key)
    in_flight = InFlight()
    app = web.Application(
        # Outermost first: metrics see the final status of every answer, 401s included; an admin
        # call, once accepted, runs to its end (errors answered inside it) if its caller leaves.
        middlewares=[
            metrics.middleware(),
            in_flight.middleware(),
            abandoning.middleware(DATA_PLANE_PATHS),
            openai_errors_middleware,
            access.middleware(),
        ],
        client_max_size=config.max_request_bytes,
    )
    app[IN_FLIGHT] = in_flight
    supervisor = Supervisor(registry, config)
    app[REGISTRY] = registry
    app[LEASES] = LocalLeases(registry)
    app[GROUP_PREFIX_CHARS] = config.group_prefix_chars
    app[SUPERVISOR] = supervisor
    app[METRICS] = metrics
    app[CONTROL] = ControlPlane(registry, config.control_timeout_s)
    try:
        chosen = transport_for(kind, config.colocate, config.weight_transport)
    except ValueError as exc:
        raise LayoutError(str(exc)) from None
    transport = FrontTransport(
        chosen,
        config.workers_per_engine,
        config.weight_transfer_timeout_s,
        config.allow_pickled_ipc,
    )
    app[WEIGHT_SYNC] = WeightSync(
        registry,
        transport,
        config.model,
        config.weight_transfer_timeout_s,
        supervisor,
        app[CONTROL],
        metrics,
        config.max_push_failures,
        config.online_quantization,
    )
    adapter_dir = config.adapter_dir or tempfile.mkdtemp(prefix="skyinfer-adapters-")
    app[ADAPTERS] = AdapterFleet(
        registry,
        app[WEIGHT_SYNC],
        config.model,
        adapter_dir,
        config.weight_transfer_timeout_s,
        supervisor.restart_in_background,
    )
    app[CATCH_UP] = CatchUp(registry, app[WEIGHT_SYNC], config.weight_transfer_timeout_s)
    app[WEIGHT_SYNC].push.catch_up_later = app[CATCH_UP].after_restart
    supervisor.bring_up = Bringup(registry, app[CONTROL], app[ADAPTERS], app[WEIGHT_SYNC], app[CATCH_UP]).bring

    async def engines_ctx(_app: web.Application):
        supervisor.start()
        yield
        await supervisor.stop(config.shutdown_budget_s[1])
        app[CATCH_UP].close()  # a catch-up the stop cut short leaves no file behind
        if config.socket_dir is None:
            shutil.rmtree(socket_dir, ignore_errors=True)
        if config.adapter_dir is None:
            shutil.rmtree(adapter_dir, ignore_errors=True)
        transport.update_ended()  # segments a trainer left

    app.cleanup_ctx.append(engines_ctx)
    if config.front_workers > 1:
        hub = LeaseHub(registry)
        app[WORKER_METRICS] = hub.worker_metrics
        app[FRONT_WORKERS] = FrontWorkers(
            config, os.path.join(socket_dir, "control.sock"), os.path.join(socket_dir, "leases.sock")
        )

        async def leases_ctx(app: web.Application):
            await hub.start(app[FRONT_WORKERS].leases_socket)
            yield
            await hub.close()

        app.cleanup_ctx.append(leases_ctx)
    add_data_plane_routes(app)
    app.router.add_post(FINISH_SESSION_PATH, finish_session)
    add_control_routes(app)
    add_weight_routes(app)
    add_adapter_routes(app)
    add_vllm_routes(app, config.allow_collective_rpc)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/engines", engines_view(config.engine_probe_timeout_s, app[WEIGHT_SYNC].quantization))
    add_supervisor_routes(app)
    add_catch_up_routes(app)
    app.router.add_get("/metrics", metrics_view(config.engine_probe_timeout_s))
    return app
