"""Service configuration: one attrs class holding every default."""

from __future__ import annotations

import attrs


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
    # Per-call timeout for the front's short calls to an engine (health, status).
    engine_probe_timeout_s: float = 5.0
    # Where engine Unix sockets live; None means a fresh temporary directory.
    socket_dir: str | None = None
    max_request_bytes: int = 32 * 1024 * 1024
    # Sticky sessions remembered at once; the oldest are forgotten first.
    max_sessions: int = 100_000

    @property
    def workers_per_engine(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
