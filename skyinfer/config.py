"""Service configuration: one attrs class holding every default.

Fields that ``skyinfer serve`` exposes carry their command-line help here too
(``cli=``): the parser is made from this class, so each default is written
once. The flag is the field's name with dashes, less a ``_s`` (seconds) suffix.
"""

from __future__ import annotations

import ipaddress
import re
import sys

import attrs

from .devices import given, given_value
from .ranks import EngineSize

CLI = "skyinfer.cli"
# What a colocated engine takes of its GPUs' memory, unless told otherwise: the rest is the trainer's.
COLOCATED_GPU_MEMORY_UTILIZATION = 0.5


@attrs.frozen
class CliOption:
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    # Extra spellings of the flag, as vLLM's own (-tp).
    aliases: tuple[str, ...] = ()
    # An environment variable that gives the default, for secrets kept out of `ps`.
    env: str | None = None
    group: str | None = None

    def flag(self, name: str) -> str:
        return "--" + name.removesuffix("_s").replace("_", "-")


# skyinfer's engine program; engine templates fork it (engine_templates.py), and no other.
ENGINE_COMMAND = (sys.executable, "-m", "skyinfer.engine")


def _option(default, help: str, *, validator=None, converter=None, **cli) -> attrs.Attribute:
    return attrs.field(
        default=default, validator=validator, converter=converter, metadata={CLI: CliOption(help, **cli)}
    )


_at_least_one = attrs.validators.ge(1)


def _never_or_at_least_one(_instance, attribute: attrs.Attribute, value: float) -> None:
    if value != 0 and value < 1:
        raise ValueError(f"{attribute.name} must be 0 (never) or at least 1, not {value}")


def parse_engine_sizes(value) -> tuple[tuple[int, int], ...] | None:
    """``--engine-sizes``: ``"2x1,1x2,1x1"`` (or pairs already) to one (tensor, pipeline) parallel
    size per engine; None stays None (every engine ``-tp`` x ``-pp``)."""
    if value is None:
        return None
    parts = [p.strip() for p in value.split(",")] if isinstance(value, str) else list(value)
    if not parts or parts == [""]:
        raise ValueError("--engine-sizes names no engine: give TPxPP per engine, comma-separated (e.g. 2x1,1x2,1x1)")
    sizes = []
    for part in parts:
        if isinstance(part, str):
            match = re.fullmatch(r"(\d+)[xX](\d+)", part)
            if match is None:
                raise ValueError(
                    f"--engine-sizes {value!r}: {part!r} is not TPxPP (tensor x pipeline parallel size of one"
                    " engine, e.g. 2x1); give one per engine, comma-separated (e.g. 2x1,1x2,1x1)"
                )
            pair = (int(match[1]), int(match[2]))
        else:
            pair = tuple(part)
            if len(pair) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) for n in pair):
                raise ValueError(f"engine_sizes {value!r}: {part!r} is not a (tensor, pipeline) pair of integers")
        if min(pair) < 1:
            raise ValueError(
                f"--engine-sizes {value!r}: {part!r} has a size below 1; each engine's tensor and pipeline"
                " parallel sizes are at least 1"
            )
        sizes.append(pair)
    return tuple(sizes)


class InsecureBindError(ValueError):
    """The service would expose its admin routes, unauthenticated, beyond this machine."""


def check_bind(host: str, admin_key: str | None, allow_unauthenticated_admin: bool) -> None:
    """Refuse to expose unauthenticated admin routes beyond this machine."""
    if admin_key or allow_unauthenticated_admin or is_loopback(host):
        return
    raise InsecureBindError(
        f"refusing to listen on {host!r} without an admin key: anyone who reaches it could pause the "
        "engines or replace their weights. Set --admin-key (or SKYINFER_ADMIN_KEY), bind 127.0.0.1, or "
        "pass --allow-unauthenticated-admin if the network is yours alone."
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


@attrs.frozen
class ServeConfig:
    model: str
    engines: int = _option(1, "number of engine processes", metavar="N", validator=_at_least_one)
    tensor_parallel_size: int = _option(
        1,
        "GPUs (or CPU workers) per engine for tensor parallelism",
        metavar="TP",
        aliases=("-tp",),
        validator=_at_least_one,
    )
    pipeline_parallel_size: int = _option(
        1, "pipeline stages per engine", metavar="PP", aliases=("-pp",), validator=_at_least_one
    )
    data_parallel_size: int = _option(
        1,
        "data-parallel ranks inside each engine (vLLM's DP: one engine whose ranks each hold the model, or"
        " with --enable-expert-parallel a share of its experts; each rank takes TP x PP GPUs or CPU workers)",
        metavar="DP",
        aliases=("-dp",),
        validator=_at_least_one,
    )
    engine_sizes: tuple[tuple[int, int], ...] | None = _option(
        None,
        "engines of their own sizes, one TPxPP each: 2x1,1x2,1x1 starts three engines (tensor parallel 2;"
        " pipeline parallel 2; one worker), on consecutive GPUs or cores, instead of --engines of -tp x -pp each",
        metavar="TPxPP,...",
        converter=parse_engine_sizes,
    )
    host: str = _option("127.0.0.1", "address to bind")
    port: int = _option(8000, "port to bind")
    front_workers: int = _option(
        1,
        "N of 2 or more: N worker processes accept on the port and relay the data plane, besides the control "
        "process (not one of the N: N+1 processes in all), which keeps routing, admin and weight calls and the "
        "engines and no longer accepts on the port (for engines that emit more than one core can relay); 1: no "
        "worker, the front alone accepts on the port and serves everything",
        metavar="N",
        validator=_at_least_one,
    )
    # vLLM engine arguments, passed to every engine as `vllm serve` takes them.
    engine_args: tuple[str, ...] = ()
    device: str = _option("auto", "auto: cuda if nvidia-ml-py sees GPUs, else cpu", choices=("auto", "cuda", "cpu"))
    colocate: bool = _option(
        False,
        "the trainer shares the engines' devices: engines sleep while it trains (sleep mode, and on GPUs "
        f"--gpu-memory-utilization {COLOCATED_GPU_MEMORY_UTILIZATION} unless given) and take weights from its memory "
        "(CUDA IPC on GPUs, shared memory on CPU) instead of a process group",
    )
    weight_transport: str = _option(
        "auto",
        "how pushed weights reach the engines; auto: by device and --colocate (a gloo group on CPU, NCCL on GPUs;"
        " colocated, shared memory on CPU, CUDA IPC on GPUs). nccl on CPU: vLLM's NCCL rendezvous and wire into"
        " skyinfer's receiver over a gloo communicator in NCCL's place (how the test suite runs the GPU path; the"
        " trainer's communicator must be swapped the same way)",
        choices=("auto", "gloo", "nccl", "shm", "ipc"),
    )
    staged_swap: str = _option(
        "auto",
        "how a staged push's weights go into the live model; auto: copied in place on GPUs (CUDA graphs hold the"
        " live tensors' addresses), pointed at on CPU (no copy between two steps); in-place: copied on CPU too"
        " (what GPUs do: how the test suite runs their swap)",
        choices=("auto", "in-place"),
    )
    # vLLM's VLLM_CPU_KVCACHE_SPACE; unused on GPU.
    cpu_kvcache_gib: int = _option(
        1, "KV cache per engine on CPU, GiB (vLLM's --kv-cache-memory-bytes, when given, instead)", metavar="GIB"
    )
    engine_start_timeout_s: float = _option(600.0, "seconds an engine may take to start", metavar="SECONDS")
    engine_stop_timeout_s: float = 30.0
    # Per engine; pause in "wait" mode waits for requests to drain.
    control_timeout_s: float = _option(300.0, "seconds each engine gets for an admin call", metavar="SECONDS")
    weight_transfer_timeout_s: float = _option(
        120.0, "seconds a trainer gets to join, and each transfer step gets to finish", metavar="SECONDS"
    )
    # A crashed engine that served 10 s or more is restarted at once (unless max_restarts retires
    # it); one that died sooner (or whose
    # restart failed) after restart_backoff_s, doubling per consecutive crash up to
    # restart_backoff_max_s (supervisor.py); staying up restart_window_s makes the next crash count
    # as the first.
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 60.0
    restart_window_s: float = _option(
        300.0,
        "an engine that stays up this long after a restart has its failed restarts forgotten",
        metavar="SECONDS",
        validator=attrs.validators.gt(0),
    )
    max_restarts: int = _option(
        5,
        "an engine that needs more restarts in a row than N (none of them staying up --restart-window) is "
        "retired: out of the fleet until POST /engines/{id}/restart",
        metavar="N",
        validator=attrs.validators.ge(0),
    )
    warm_spares: int = _option(
        1,
        "1: once the fleet is ready, each engine gets a spare process that waits to become it (see "
        "--loaded-spares); when the engine's process dies or is restarted, its spare takes its place, and a new "
        "spare starts once the engine is up; 0: no spares, every restart starts a cold process",
        metavar="N",
        validator=attrs.validators.in_((0, 1)),
    )
    loaded_spares: str = _option(
        "auto",
        "with --warm-spares 1, each spare builds its whole engine (model loaded, KV cache) before it waits: a "
        "restart then costs the catch-up of the fleet's weights alone (on CPU about a second instead of 20), and each "
        "spare holds a whole engine's memory; off: a spare only imports torch and vLLM (about 0.6 GiB; it saves "
        "5 s of a restart); auto: loaded on CPU engines, not on GPUs (a second engine would not fit beside the first)",
        choices=("auto", "on", "off"),
    )
    engine_templates: str = _option(
        "auto",
        "auto: CPU engines and their spares are forked from a process that imported torch and vLLM once (an engine "
        "template, one per engine environment), instead of each importing them again: an engine of the demo model "
        "starts in about 3 s instead of 10, a restart too; off: every engine process starts cold",
        choices=("auto", "off"),
    )
    engine_template_socket: str | None = _option(
        None,
        "with --engine-templates auto: fork CPU engines from the engine templates hosted at PATH (python -m "
        "skyinfer.engine.template --listen PATH --lifeline-fd FD, of this user: one template per engine environment), "
        "which the servers of one machine share (the test suite's do); where they are gone or hung, this server "
        "starts its own",
        metavar="PATH",
    )
    max_push_failures: int = _option(
        3,
        "an engine that stays up but fails N weight pushes in a row by itself (the other engines did their "
        "part) is retired: out of the fleet, which trains on, until POST /engines/{id}/restart",
        metavar="N",
        validator=_at_least_one,
    )
    # Per-call timeout for the front's short calls to an engine (status views, start-up polling).
    engine_probe_timeout_s: float = 5.0
    # Liveness probe of every running engine: health_failures probes in a row
    # that fail or take over health_timeout_s make the engine dead (killed,
    # restarted); one that times out while a call of the front's to the engine
    # runs is not counted. On 2 busy CPU cores a probe can take a second or two.
    health_interval_s: float = _option(5.0, "seconds between liveness probes of each engine", metavar="SECONDS")
    health_timeout_s: float = _option(
        10.0, "a probe slower than this fails; enough failures in a row restart the engine", metavar="SECONDS"
    )
    health_failures: int = attrs.field(default=3, validator=_at_least_one)
    # Where engine Unix sockets live; None means a fresh temporary directory.
    socket_dir: str | None = None
    # The engine program, given the engine's own arguments and vLLM's: skyinfer's engine. The
    # front's own tests and benchmark run a fake one (tools/fake_engine.py) in its place.
    engine_command: tuple[str, ...] = attrs.field(default=ENGINE_COMMAND, converter=tuple)
    adapter_dir: str | None = _option(
        None,
        "where each version of each LoRA adapter is kept for the engines (None: a temporary directory)",
        metavar="DIR",
    )
    max_request_mb: float = _option(
        32.0, "largest request body accepted, MiB", metavar="MIB", validator=attrs.validators.ge(1 / 1024)
    )
    # Sticky sessions remembered at once; the oldest are forgotten first.
    max_sessions: int = 100_000
    session_idle_ttl_s: float = _option(
        3600.0,
        "a session unused this long loses its engine binding (0: never); POST /finish_session ends one",
        metavar="SECONDS",
        validator=attrs.validators.ge(0),
    )
    session_rebalance_factor: float = _option(
        2.0,
        "a session moves to the least-loaded engine at its next request when its own engine has more than "
        "FACTOR x (that one's + 1) requests in flight (0: never)",
        metavar="FACTOR",
        validator=_never_or_at_least_one,
    )
    group_prefix_chars: int = _option(
        1024,
        "requests without a session whose prompts' first CHARS characters match (a GRPO group's samples) go "
        "to the same engine while it is not overloaded (0: no group affinity)",
        metavar="CHARS",
        validator=attrs.validators.ge(0),
    )
    group_slack: int = _option(
        8,
        "a prompt group leaves its engine when that one has more than N requests in flight beyond the "
        "least-loaded engine's",
        metavar="N",
        validator=attrs.validators.ge(0),
    )
    engine_connections: int = _option(
        4096,
        "requests sent to one engine at once; more wait in the front for a connection",
        metavar="N",
        validator=_at_least_one,
    )
    hold_requests_s: float = _option(
        60.0,
        "a request that finds no engine serving (all restarting, or stale until the next push) waits up to "
        "this long for one, then gets 503 with Retry-After",
        metavar="SECONDS",
        validator=attrs.validators.ge(0),
    )
    engine_queue_limit: int = _option(
        0,
        "requests that may wait per engine before new ones get 503 with Retry-After (0: no cap)",
        metavar="N",
        validator=attrs.validators.ge(0),
    )
    # SIGTERM / Ctrl-C: in-flight requests, then the engines' clean exit, must all fit in it.
    shutdown_grace_s: float = _option(
        30.0,
        "on SIGTERM/Ctrl-C: seconds for in-flight requests to finish and engines to exit",
        metavar="SECONDS",
        validator=attrs.validators.gt(0),
    )
    # The API key guards the data plane, the admin key control and weight
    # routes (the API key too when no admin key is set).
    api_key: str | None = attrs.field(
        default=None,
        repr=False,
        metadata={
            CLI: CliOption(
                "Bearer key for the OpenAI routes (none: open)", metavar="KEY", env="SKYINFER_API_KEY", group="security"
            )
        },
    )
    admin_key: str | None = attrs.field(
        default=None,
        repr=False,
        metadata={
            CLI: CliOption(
                "Bearer key for control, weight and engine routes (none: the API key)",
                metavar="KEY",
                env="SKYINFER_ADMIN_KEY",
                group="security",
            )
        },
    )
    allow_collective_rpc: tuple[str, ...] = attrs.field(
        default=(),
        converter=tuple,
        metadata={
            CLI: CliOption(
                "a worker method POST /collective_rpc may run on every engine (repeat the flag for "
                "more; none: the route is refused, as it runs arbitrary code)",
                metavar="METHOD",
                group="security",
            )
        },
    )
    allow_pickled_ipc: bool = _option(
        False,
        "take vLLM's own IPC trainer's updates, whose CUDA IPC handles come pickled (ipc_handles_pickled); "
        "the engines then unpickle what an admin caller sends, as vLLM's VLLM_ALLOW_INSECURE_SERIALIZATION=1 does. "
        "Needs --colocate and --admin-key (or SKYINFER_ADMIN_KEY), on any address, loopback included",
        group="security",
    )
    allow_unauthenticated_admin: bool = _option(
        False,
        "allow a non-loopback --host without an admin key (only on a network that is yours alone)",
        group="security",
    )

    def __attrs_post_init__(self) -> None:
        check_bind(self.host, self.admin_key, self.allow_unauthenticated_admin)
        if self.engine_sizes is not None:
            self._check_engine_sizes()
        if any(given(flag, self.engine_args) for flag in ("--data-parallel-size", "-dp", "--data-parallel-size-local")):
            raise ValueError(
                "--data-parallel-size among the engine arguments: give it to skyinfer (-dp N, before the engine"
                " arguments), which counts each engine's workers for devices and weight-transfer ranks"
            )
        if given("--config", self.engine_args):
            raise ValueError(
                "--config among the engine arguments: skyinfer reads the engine arguments to plan devices and"
                " ranks and to refuse the ones it sets itself, which a config file would hide from it; give them"
                " on the command line"
            )
        if given("--weight-transfer-config", self.engine_args):
            raise ValueError(
                "--weight-transfer-config among the engine arguments: skyinfer gives every engine its own receiver"
                " for the transport it runs (--weight-transport), which keeps a failed push's outcome, the rest of"
                " a layer a push filled in part and the CPU kernels; leave it out"
            )
        if self.allow_pickled_ipc and not self.colocate:
            raise ValueError("--allow-pickled-ipc is for a colocated server's IPC transport: add --colocate")
        if self.allow_pickled_ipc and not self.admin_key:
            # On loopback too: any local process, or a web page the operator's browser opens, reaches 127.0.0.1.
            raise ValueError(
                "--allow-pickled-ipc needs an admin key, on any address (loopback included): the engines "
                "unpickle the ipc_handles_pickled an admin caller sends, which runs any code that caller "
                "chooses, so only holders of the admin key may send one. Set --admin-key KEY (or "
                "SKYINFER_ADMIN_KEY) and give the trainer the same key, or leave --allow-pickled-ipc out "
                "(skyinfer's IPCTrainer needs no pickles)"
            )

    @property
    def online_quantization(self) -> str | None:
        """The method the engines quantize a full-precision checkpoint with as they load it (vLLM's
        ``--quantization``, e.g. ``fp8``), or None."""
        return given_value(("--quantization", "-q"), self.engine_args)

    @property
    def engine_parallel(self) -> tuple[EngineSize, ...]:
        """Each engine's sizes: ``engine_sizes`` (tensor, pipeline), or ``-tp`` x ``-pp`` for every
        one; ``-dp`` for every one."""
        pairs = self.engine_sizes or ((self.tensor_parallel_size, self.pipeline_parallel_size),) * self.engines
        return tuple(EngineSize(tp, pp, self.data_parallel_size) for tp, pp in pairs)

    @property
    def workers_per_engine(self) -> tuple[int, ...]:
        """Each engine's workers (GPUs, or CPU worker ranks): tp x pp x dp of its own."""
        return tuple(size.workers for size in self.engine_parallel)

    def _check_engine_sizes(self) -> None:
        """``--engine-sizes`` sets the engines and their sizes: ``--engines``, ``-tp`` and ``-pp`` may
        only repeat what it says; ``engines`` becomes its count."""
        sizes, count = self.engine_sizes, len(self.engine_sizes)
        shown = ",".join(f"{tp}x{pp}" for tp, pp in sizes)
        if self.engines not in (1, count):
            raise ValueError(
                f"--engines {self.engines} disagrees with --engine-sizes {shown}, which starts {count} engine(s):"
                " leave --engines out (--engine-sizes sets the count)"
            )
        for name, flag, index in (("tensor_parallel_size", "-tp", 0), ("pipeline_parallel_size", "-pp", 1)):
            value = getattr(self, name)
            if value != 1 and any(size[index] != value for size in sizes):
                raise ValueError(
                    f"{flag} {value} disagrees with --engine-sizes {shown}, which gives each engine its own"
                    f" sizes: leave {flag} out"
                )
        object.__setattr__(self, "engines", count)

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * 1024 * 1024)

    @property
    def shutdown_budget_s(self) -> tuple[float, float]:
        """The shutdown grace split into (in-flight requests, engines' clean exit); SIGKILL after."""
        engines_s = min(self.engine_stop_timeout_s, self.shutdown_grace_s / 4)
        return self.shutdown_grace_s - engines_s, engines_s


def cli_fields() -> list[tuple[attrs.Attribute, CliOption]]:
    """The fields ``skyinfer serve`` exposes, in declaration order."""
    return [(f, f.metadata[CLI]) for f in attrs.fields(ServeConfig) if CLI in f.metadata]
