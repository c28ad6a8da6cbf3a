"""Service configuration: one attrs class holding every default."""

from __future__ import annotations

import attrs

from .security import check_bind


@attrs.frozen
class ServeConfig:
    model: str
    engines: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    tensor_parallel_size: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    pipeline_parallel_size: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    host: str = "127.0.0.1"
    port: int = 8000
    # vLLM engine arguments, passed to every engine as `vllm serve` takes them.
    engine_args: tuple[str, ...] = ()
    # "auto" picks cuda when nvidia-ml-py sees GPUs, else cpu.
    device: str = "auto"
    # KV cache per CPU engine (vLLM's VLLM_CPU_KVCACHE_SPACE); unused on GPU.
    cpu_kvcache_gib: int = 1
    engine_start_timeout_s: float = 600.0
    engine_stop_timeout_s: float = 30.0
    # Per-engine timeout of an admin call (pause in "wait" mode waits for requests to drain).
    control_timeout_s: float = 300.0
    # Bounds the trainer rendezvous and each transfer step.
    weight_transfer_timeout_s: float = 120.0
    # A crashed engine is restarted after restart_backoff_s, doubling per
    # consecutive crash up to restart_backoff_max_s; staying up
    # restart_backoff_reset_s makes the next crash count as the first.
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 60.0
    restart_backoff_reset_s: float = 120.0
    # Per-call timeout for the front's short calls to an engine (status views, start-up polling).
    engine_probe_timeout_s: float = 5.0
    # Liveness probe of every running engine: health_failures probes in a row
    # that fail or take over health_timeout_s make the engine dead (killed,
    # restarted). On 2 busy CPU cores a probe can take a second or two.
    health_interval_s: float = 5.0
    health_timeout_s: float = 10.0
    health_failures: int = attrs.field(default=3, validator=attrs.validators.ge(1))
    # Where engine Unix sockets live; None means a fresh temporary directory.
    socket_dir: str | None = None
    max_request_bytes: int = attrs.field(default=32 * 1024 * 1024, validator=attrs.validators.ge(1024))
    # Bearer keys: the API key guards the data plane, the admin key control
    # and weight routes (the API key too when no admin key is set).
    api_key: str | None = attrs.field(default=None, repr=False)
    admin_key: str | None = attrs.field(default=None, repr=False)
    # Listening beyond loopback without an admin key is refused unless this is set.
    allow_unauthenticated_admin: bool = False
    # SIGTERM / Ctrl-C: in-flight requests, then the engines' clean exit,
    # must all fit in this many seconds.
    shutdown_grace_s: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))
    # Sticky sessions remembered at once; the oldest are forgotten first.
    max_sessions: int = 100_000
    # Requests the front sends one engine at once (each holds a connection);
    # more wait in the front, in arrival order, for one to finish.
    engine_connections: int = attrs.field(default=4096, validator=attrs.validators.ge(1))
    # Requests that may wait so per engine before a new one is answered 503
    # with Retry-After; 0: no cap (load queues, it never fails).
    engine_queue_limit: int = attrs.field(default=0, validator=attrs.validators.ge(0))

    def __attrs_post_init__(self) -> None:
        check_bind(self.host, self.admin_key, self.allow_unauthenticated_admin)

    @property
    def workers_per_engine(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def shutdown_budget_s(self) -> tuple[float, float]:
        """The shutdown grace split into (in-flight requests, engines' clean exit); SIGKILL after."""
        engines_s = min(self.engine_stop_timeout_s, self.shutdown_grace_s / 4)
        return self.shutdown_grace_s - engines_s, engines_s
