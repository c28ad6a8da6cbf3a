"""Sphinx directives that write skyinfer's reference from the code itself, never by hand:

* ``.. skyinfer-routes::`` — every route the front registers (``create_app``'s own route table),
  grouped by the module that serves it, with the parameters its handler reads (``wire.takes``)
  and the first paragraph of its docstring;
* ``.. skyinfer-options::`` — every field of ``ServeConfig``, with its ``skyinfer serve`` flag (and
  its other spellings), default, environment variable and help where it is a command-line option;
* ``.. skyinfer-metrics::`` — every metric ``GET /metrics`` exports of skyinfer's own, read off the
  app ``create_app`` builds (its Prometheus registry and collectors): name, type, labels and help;
* ``.. skyinfer-environment::`` — every environment variable skyinfer reads, and those it sets for
  its engines: the ones ``ServeConfig``'s options take (``CliOption.env``) generated, the engines'
  device variables checked against ``skyinfer.devices``, the rest written once below
  (``READ_ENVIRONMENT``, ``ENGINE_ENVIRONMENT``, ``TOOLS_ENVIRONMENT``; ``tests/test_docs.py`` greps
  the code for any they miss).
"""

from __future__ import annotations

import inspect
import sys
import tempfile
from collections.abc import Iterator

import attrs
from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList
from prometheus_client.metrics import MetricWrapperBase
from sphinx.util import logging
from sphinx.util.nodes import nested_parse_with_titles

from skyinfer.admin.metrics import _PREFIX_HITS, _PREFIX_QUERIES, CLIENT_CLOSED, METRICS, prefix_cache_hit_rates
from skyinfer.config import CLI, ServeConfig, cli_fields
from skyinfer.devices import split_cores, split_gpus
from skyinfer.fleet.state import EngineState
from skyinfer.front.app import create_app
from skyinfer.weights.phases import Phase

log = logging.getLogger(__name__)

# How a handler's docstring begins the paragraph on what becomes of a call its caller abandons.
ABANDONED = "If its caller leaves: "
# The modules that serve routes, in the order the reference shows them.
SECTIONS = {
    "skyinfer.serving.proxy": "Data plane (one engine answers)",
    "skyinfer.serving.sessions": "Data plane (one engine answers)",
    "skyinfer.admin.vllm_routes": "vLLM's other routes, for the fleet",
    "skyinfer.admin.control": "Control plane (every engine)",
    "skyinfer.weights.routes": "Weight transfer",
    "skyinfer.weights.adapters": "LoRA adapters",
    "skyinfer.admin.health": "Operations",
    "skyinfer.admin.metrics": "Operations",
    "skyinfer.fleet.supervisor": "Operations",
    "skyinfer.weights.catchup": "Operations",
}


@attrs.frozen
class Route:
    method: str
    path: str
    module: str
    # The handler's own function: routes served by one function are listed together.
    handler: object
    summary: str
    parameters: list[tuple[str, str, str]]
    # What becomes of the call if its caller leaves half-way (the docstring's paragraph that says so).
    abandoned: str | None = None


def _front_app():
    """The app ``skyinfer serve`` runs, as ``create_app`` builds it: no engine starts."""
    with tempfile.TemporaryDirectory() as socket_dir:
        return create_app(ServeConfig(model=socket_dir, device="cpu", socket_dir=socket_dir, adapter_dir=socket_dir))


def front_routes() -> list[Route]:
    """Every (method, path) the front registers, from the app ``create_app`` builds (no engine starts)."""
    app = _front_app()
    routes = []
    for route in app.router.routes():
        if route.method == "HEAD":
            continue  # aiohttp adds one beside each GET
        handler = route.handler
        doc = inspect.getdoc(handler) or ""
        takes = getattr(handler, "takes", None)
        schema = takes.model_json_schema() if takes is not None else {"properties": {}}
        parameters = (
            []
            if takes is None
            else [
                (
                    name,
                    _json_type(schema["properties"][name], schema),
                    "required" if field.is_required() else f"default {field.default!r}",
                )
                for name, field in takes.model_fields.items()
            ]
        )
        paragraphs = doc.split("\n\n")
        abandoned = next((p.removeprefix(ABANDONED) for p in paragraphs if p.startswith(ABANDONED)), None)
        routes.append(
            Route(
                route.method,
                route.resource.canonical,
                handler.__module__,
                handler,
                paragraphs[0],
                parameters,
                abandoned,
            )
        )
    return routes


def _json_type(prop: dict, schema: dict) -> str:
    """A parameter's JSON type, as a user writes it: ``integer``, ``"abort" | "wait"``, ``array of string``."""
    if "$ref" in prop:
        return _json_type(schema["$defs"][prop["$ref"].rsplit("/", 1)[1]], schema)
    if "enum" in prop:
        return " | ".join(f'"{v}"' for v in prop["enum"])
    if "const" in prop:
        return f'"{prop["const"]}"'
    if "anyOf" in prop:
        return " | ".join(_json_type(p, schema) for p in prop["anyOf"])
    if prop.get("type") == "array":
        items = _json_type(prop.get("items", {}), schema)
        return f"array of ({items})" if "|" in items else f"array of {items}"
    return prop.get("type", "any")


def _route_lines(routes: list[Route]) -> Iterator[str]:
    by_section: dict[str, list[Route]] = {}
    for route in routes:
        by_section.setdefault(SECTIONS.get(route.module, "Other"), []).append(route)
    for section, members in by_section.items():
        yield section
        yield "-" * len(section)
        yield ""
        by_handler: dict[int, list[Route]] = {}
        for route in sorted(members, key=lambda r: (r.path, r.method)):
            by_handler.setdefault(id(route.handler), []).append(route)
        for group in by_handler.values():
            yield ", ".join(f"``{r.method} {r.path}``" for r in group)
            yield "   " + (group[0].summary or "Served by vLLM's own handler.").replace("\n", " ")
            if group[0].parameters:
                yield ""
            for name, kind, default in group[0].parameters:
                yield f"   - ``{name}``: {kind}, {default}"
            if group[0].abandoned:
                yield ""
                yield "   *If its caller leaves:* " + group[0].abandoned.strip().replace("\n", " ")
            yield ""


# The fields ``skyinfer serve`` takes in its own way rather than as ``--<field name>``.
_OWN_WAY = {
    "model": "a local directory or a Hugging Face name (``--model PATH``); without it, the built-in demo model,"
    " built in ``$SKYINFER_CACHE/demo-model`` (``SKYINFER_CACHE`` unset: ``~/.cache/skyinfer``)",
    "engine_args": "every option ``skyinfer serve`` does not know, given to every engine as ``vllm serve`` takes it",
}


def option_lines() -> Iterator[str]:
    for field in attrs.fields(ServeConfig):
        cli = field.metadata.get(CLI)
        default = field.default.factory() if isinstance(field.default, attrs.Factory) else field.default
        # The interpreter's path is this machine's: say what it is instead.
        shown = (
            "required"
            if default is attrs.NOTHING
            else f"default ``{default!r}``".replace(repr(sys.executable), "sys.executable")
        )
        if cli is not None:
            flags = ", ".join(f"``{flag}``" for flag in (cli.flag(field.name), *cli.aliases))
            env = f", or ``${cli.env}``" if cli.env else ""
            yield f"{flags} (``{field.name}``, {shown}{env})"
            yield f"   {cli.help}"
        elif field.name == "model":
            yield f"``--model`` (``{field.name}``, default: the built-in demo model)"
            yield f"   {_OWN_WAY[field.name]}"
        elif field.name in _OWN_WAY:
            yield f"``{field.name}`` ({shown})"
            yield f"   {_OWN_WAY[field.name]}"
        else:
            yield f"``{field.name}`` (Python only, {shown})"
            yield "   Set through ``ServeConfig`` (not a ``skyinfer serve`` flag)."
        yield ""


@attrs.frozen
class ExportedMetric:
    # The family's name; a counter's samples add ``_total``, a histogram's ``_bucket``, ``_sum``, ``_count``.
    name: str
    kind: str
    labels: tuple[str, ...]
    help: str
    # A histogram's upper bounds (its last, +Inf, left out).
    buckets: tuple[float, ...] = ()

    @property
    def exposed(self) -> str:
        """The name a scrape shows (a counter's samples are ``<name>_total``)."""
        return self.name + "_total" if self.kind == "counter" else self.name


def front_metrics() -> list[ExportedMetric]:
    """Every metric of the front's own, in the order ``/metrics`` shows them: the collectors registered
    in the app's Prometheus registry (those counted as requests come, and those read off the engine
    registry at each scrape)."""
    registry = _front_app()[METRICS].prom
    metrics = []
    for collector in list(registry._collector_to_names):
        if isinstance(collector, MetricWrapperBase):
            buckets = tuple(b for b in getattr(collector, "_upper_bounds", ()) if b != float("inf"))
            metrics.append(
                ExportedMetric(
                    collector._name, collector._type, collector._labelnames, collector._documentation, buckets
                )
            )
        else:
            metrics += [
                ExportedMetric(family.name, family.type, tuple(family._labelnames), family.documentation)
                for family in collector.collect()
            ]
    return metrics


def derived_metrics() -> list[ExportedMetric]:
    """The metrics the front computes at each scrape from its engines' own vLLM metrics."""
    rates = prefix_cache_hit_rates([])
    return [ExportedMetric(rates.name, rates.type, tuple(rates._labelnames), rates.documentation)]


# What each label of skyinfer's metrics holds: a metric with a label missing here fails the docs build.
METRIC_LABELS = {
    "engine": "the engine's id, as ``GET /engines`` numbers them; in ``skyinfer_requests_total``, the engine"
    " that answered (the ``X-Skyinfer-Engine`` header), empty for calls no single engine answered (admin"
    " calls, refusals by the front)",
    "route": "the route as the front registers it (``/v1/chat/completions``, ``/engines/{engine_id}/restart``:"
    " :doc:`route-table`); ``unmatched`` for every path that matches no route",
    "status": f"the HTTP status of the answer; ``{CLIENT_CLOSED}`` (nginx's code) when the caller went away"
    " before the answer",
    "state": "one of " + ", ".join(f"``{s.value}``" for s in EngineState) + ": the series of the state the engine"
    " is in is 1, the others 0",
    "version": "the weight version the engine reports (``default``: the checkpoint it loaded; empty until it says)",
    "carried": "``sent``: the bytes the pushes moved; ``dense``: the bytes of the tensors they updated, whole"
    " (a delta push moves fewer)",
    "phase": "one of " + ", ".join(f"``{p.value}``" for p in Phase) + " (:doc:`../guides/rl-loop`, *Phases*):"
    " the series of the fleet's phase is 1, the others 0",
}


def _metric_lines(metrics: list[ExportedMetric]) -> Iterator[str]:
    for metric in metrics:
        labels = ", ".join(f"``{label}``" for label in metric.labels) or "none"
        if metric.kind == "histogram":
            kind = "histogram: ``_bucket`` (label ``le``), ``_sum``, ``_count``"
        else:
            kind = metric.kind
        yield f"``{metric.exposed}``"
        yield f"   {metric.help.strip()[:1].upper()}{metric.help.strip()[1:]}."
        yield ""
        yield f"   *Type:* {kind}. *Labels:* {labels}."
        if metric.buckets:
            yield f"   *Buckets (upper bounds):* {', '.join(f'{b:g}' for b in metric.buckets)}."
        yield ""
        for label in metric.labels:
            if label not in METRIC_LABELS:
                log.warning("metric %s: its label %r has no entry in METRIC_LABELS", metric.exposed, label)


def metrics_lines() -> Iterator[str]:
    own, derived = front_metrics(), derived_metrics()
    for metric in (*own, *derived):
        if not metric.help.strip():
            log.warning("metric %s has no help text", metric.exposed)
    probe_s = attrs.fields(ServeConfig).engine_probe_timeout_s.default
    yield "The front's own"
    yield "---------------"
    yield ""
    yield (
        "Requests and weight pushes are counted as they happen; the engines' state is read off the front's"
        " engine registry at each scrape, one series per engine. With ``--front-workers N`` every process"
        " counts the requests it answers and ``/metrics`` adds them up. Counters and histograms that the front counts itself also carry prometheus_client's"
        " ``_created`` sample (when the series began, Unix seconds)."
    )
    yield ""
    yield from _metric_lines(own)
    yield "From the engines' vLLM metrics"
    yield "------------------------------"
    yield ""
    yield (
        f"Computed at each scrape from every engine's own ``{_PREFIX_HITS}`` and ``{_PREFIX_QUERIES}``"
        " counters (since the engine started); an engine that has looked nothing up has no series."
    )
    yield ""
    yield from _metric_lines(derived)
    yield "Every engine's vLLM metrics"
    yield "---------------------------"
    yield ""
    yield (
        "Then every metric of every engine's vLLM (``vllm:...``: its requests, tokens, latencies, KV cache"
        " and prefix cache, as vLLM documents them), fetched at each scrape from every engine that is up, with"
        " the label ``engine`` set to the engine's id (it replaces vLLM's own ``engine`` label, the index of"
        " an engine within one vLLM server). An engine that does not answer within"
        f" ``engine_probe_timeout_s`` ({probe_s:g} s) is left out of that scrape; the front's own metrics"
        " are there whatever the engines do."
    )
    yield ""
    yield "Labels"
    yield "------"
    yield ""
    used = {label for metric in (*own, *derived) for label in metric.labels}
    for label, meaning in METRIC_LABELS.items():
        if label in used:
            yield f"``{label}``"
            yield f"   {meaning[:1].upper()}{meaning[1:]}."
            yield ""


@attrs.frozen
class EnvVar:
    name: str
    # Who reads it, or sets it, and where.
    where: str
    meaning: str


# The variables each engine process gets from the front (besides the front's own environment), by
# name; the device ones are checked against what ``skyinfer.devices`` sets for a GPU and a CPU engine.
ENGINE_ENVIRONMENT = {
    "CUDA_VISIBLE_DEVICES": EnvVar(
        "CUDA_VISIBLE_DEVICES",
        "set for each engine on GPUs (``skyinfer/devices.py``)",
        "the engine's own group of ``tp x pp`` GPUs, named as the front's ``CUDA_VISIBLE_DEVICES`` names them",
    ),
    "VLLM_USE_FLASHINFER_SAMPLER": EnvVar(
        "VLLM_USE_FLASHINFER_SAMPLER",
        "set to 0 for each engine on GPUs where FlashInfer is not installed and the front's environment"
        " does not set it (``skyinfer/devices.py``)",
        "vLLM's own sampler instead of FlashInfer's: vLLM 0.33's EngineCore died at start-up without"
        " FlashInfer (docs/gpu-runs/2026-11-26-h200)",
    ),
    "VLLM_CPU_OMP_THREADS_BIND": EnvVar(
        "VLLM_CPU_OMP_THREADS_BIND",
        "set for each engine on CPU (``skyinfer/devices.py``)",
        "the engine's own cores, one list per worker rank separated by ``|``, as vLLM takes it (vLLM's"
        " default would bind every engine to the same cores)",
    ),
    "VLLM_CPU_KVCACHE_SPACE": EnvVar(
        "VLLM_CPU_KVCACHE_SPACE",
        "set for each engine on CPU (``skyinfer/devices.py``), unless the engine's arguments give vLLM's"
        " ``--kv-cache-memory-bytes``",
        "the engine's KV cache in GiB: ``--cpu-kvcache-gib`` (vLLM's CPU platform lets it override"
        " ``--kv-cache-memory-bytes``, so it is left out when that is given)",
    ),
    "OMP_WAIT_POLICY": EnvVar(
        "OMP_WAIT_POLICY",
        "set to ``PASSIVE`` for each engine on CPU where the front's environment does not set it"
        " (``skyinfer/devices.py``)",
        "the workers' OpenMP threads sleep as soon as they wait instead of spinning first: the engine's"
        ' other processes and the front share their cores (docs: benchmarks-journal, "OpenMP threads that'
        ' sleep"); ``ACTIVE`` keeps them spinning, for cores nothing else runs on',
    ),
    "SKYINFER_COVERAGE_ON_SIGTERM": EnvVar(
        "SKYINFER_COVERAGE_ON_SIGTERM",
        "set by ``tools/weight_path_coverage.py`` for the suite it measures; nothing else reads it",
        "a measured process's SIGTERM handler first saves coverage's data and has its Python"
        " descendants save theirs (a ``.pth`` hook the tool puts in the environment for the run)",
    ),
    "SKYINFER_STAGED_SWAP": EnvVar(
        "SKYINFER_STAGED_SWAP",
        "set to ``in-place`` for each engine by ``skyinfer serve --staged-swap in-place``",
        "a staged push's weights are copied into the live tensors on CPU too, as on GPUs, instead of"
        " the live parameters being pointed at them (``skyinfer/engine/targets.py``)",
    ),
    "SKYINFER_WORKER_SPIN_S": EnvVar(
        "SKYINFER_WORKER_SPIN_S",
        "set to ``0.05`` for each engine on CPU where the front's environment does not set it"
        " (``skyinfer/devices.py``)",
        "seconds a worker spins on its message queue after each message before it sleeps on the"
        " queue's socket (vLLM's own: 1 s, a core taken after every request; docs: benchmarks-journal,"
        ' "Workers that wait asleep")',
    ),
    "VLLM_ENABLE_V1_MULTIPROCESSING": EnvVar(
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "set to 0 for each engine of one worker on CPU where the front's environment does not set it"
        " (``skyinfer/devices.py``)",
        "vLLM runs the engine's one worker inside its EngineCore, as on a GPU, instead of in a process"
        " of its own that imports torch and vLLM again (a third of an engine's start, 0.6 GiB; docs:"
        ' benchmarks, "One worker inside the EngineCore"); 1 keeps the worker process',
    ),
    "VLLM_WORKER_MULTIPROC_METHOD": EnvVar(
        "VLLM_WORKER_MULTIPROC_METHOD",
        "set to ``fork`` by each engine process on CPU, after vLLM's CPU platform set it to ``spawn``"
        " (``skyinfer/engine/cpu_platform.py``), unless the front's environment sets ``spawn``",
        "vLLM forks the engine's EngineCores, their workers and a data-parallel coordinator, as it does"
        " on a GPU, instead of spawning processes that each import torch and vLLM again (7 to 10"
        " CPU-s each; an engine of ``-dp 2`` up in seconds instead of tens; docs: benchmarks-journal,"
        ' "Every vLLM process of a CPU engine forked"); ``spawn`` keeps vLLM\'s spawned processes',
    ),
    "OMP_NUM_THREADS": EnvVar(
        "OMP_NUM_THREADS",
        "set for each engine of one worker on CPU where the front's environment does not set it"
        " (``skyinfer/devices.py``)",
        "the worker's cores: the torch threads it serves with inside the EngineCore (vLLM sets the"
        " same for a worker process of its own; unset, vLLM serves with one thread there)",
    ),
    "PYTHONUNBUFFERED": EnvVar(
        "PYTHONUNBUFFERED",
        "set for each engine (``skyinfer/fleet/engine_process.py``)",
        "``1``: the engine's output reaches the front's stderr line by line",
    ),
    "VLLM_ALLOW_INSECURE_SERIALIZATION": EnvVar(
        "VLLM_ALLOW_INSECURE_SERIALIZATION",
        "set for each engine with ``--allow-pickled-ipc`` (``skyinfer/fleet/engine_process.py``)",
        "``1``: vLLM's ``ipc`` backend unpickles ``ipc_handles_pickled`` (vLLM's own IPC trainer's updates);"
        " never set otherwise (:doc:`../guides/colocated`)",
    ),
    "VLLM_SERVER_DEV_MODE": EnvVar(
        "VLLM_SERVER_DEV_MODE",
        "set by each engine process for itself (``skyinfer/engine/__main__.py``)",
        "``1``: vLLM's app behind the engine registers its dev routes (``/server_info``, ``/collective_rpc``,"
        " ...); the engine's socket is the front's alone, and the front decides which of them users reach",
    ),
}

# The variables skyinfer itself reads, besides the options' own (``CliOption.env``).
READ_ENVIRONMENT = [
    EnvVar(
        "SKYINFER_ADMIN_KEY",
        "also ``skyinfer status``",
        "the default of its ``--admin-key``; ``tools/gpu_check.py`` hands its servers and trainer processes"
        " the admin key through it",
    ),
    EnvVar(
        "SKYINFER_CACHE",
        "``skyinfer serve`` and ``tools/check_vllm_api.py``",
        "where skyinfer keeps what it builds or downloads (default ``~/.cache/skyinfer``): the demo model that"
        " ``skyinfer serve`` without ``--model`` serves (in ``demo-model``), the vLLM wheels"
        " ``tools/check_vllm_api.py`` checks (in ``vllm-wheels``)",
    ),
    EnvVar(
        "CUDA_VISIBLE_DEVICES",
        "``skyinfer serve`` on GPUs (``skyinfer/devices.py``)",
        "the GPUs the engines share out (indices, or GPU or MIG UUIDs, all one way; unset: every GPU):"
        " engine *i* gets the *i*-th group of ``tp x pp`` of them, in the order given (a trainer on GPUs of"
        " its own sets its own ``CUDA_VISIBLE_DEVICES`` to those)",
    ),
]

# What vLLM's executor sets for each CPU worker process it starts, read by that process again when
# it was forked (its OpenMP runtime read its template's environment).
READ_ENVIRONMENT += [
    EnvVar(
        name,
        "each worker process of a CPU engine (``skyinfer/engine/cpu_platform.py``)",
        f"{what}, which vLLM's executor sets for each worker it starts: a forked worker takes them when"
        " it starts (its OpenMP runtime read its template's), a spawned one's OpenMP read them already",
    )
    for name, what in (
        ("GOMP_CPU_AFFINITY", "the worker's cores, ``0 1 2``"),
        ("OMP_PLACES", "the worker's cores, ``{0,1,2}`` (where ``GOMP_CPU_AFFINITY`` is not set)"),
    )
]

# The variables the project's tools and tests read or set (never ``skyinfer serve`` itself).
TOOLS_ENVIRONMENT = [
    EnvVar("PYTHON", "``tools/bootstrap``", "the Python that creates ``.venv`` (default ``python3``)"),
    EnvVar(
        "PYTHON_OLDEST",
        "``tools/bootstrap``",
        "a Python 3.10 for ``.venv-py310``, where ``tests/test_python310.py`` imports skyinfer (default:"
        " ``python3.10`` on the path, else pyenv's)",
    ),
    EnvVar("PYENV_ROOT", "``tools/bootstrap``", "where pyenv's Python 3.10 is looked for (default ``~/.pyenv``)"),
    EnvVar(
        "FAKE_ENGINE_SCRIPT",
        "``tools/fake_engine.py``; the tests and ``tools/bench_front.py`` set it",
        "the fake engine's behaviour, as JSON (its pace, delays, failures, hangs)",
    ),
    EnvVar(
        "PYTHONPATH",
        "``tools/bench_recovery.py``",
        "set to an older checkout (``--checkout``), whose skyinfer the server and its engines then run",
    ),
    EnvVar(
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        "``tools/bench_lora.py``",
        "``1`` for the reference ``vllm serve``, whose adapter routes need it (skyinfer's engines do not)."
        " The benchmarks likewise give their reference ``vllm serve`` processes ``VLLM_CPU_KVCACHE_SPACE``,"
        " ``VLLM_CPU_OMP_THREADS_BIND`` and ``VLLM_SERVER_DEV_MODE``, as skyinfer gives its engines",
    ),
]


def _engine_environment() -> list[EnvVar]:
    """The engines' variables, those ``skyinfer.devices`` sets for a GPU and a CPU engine first."""
    devices = {*split_gpus(["0"], (1,))[0].env, *split_cores([0], (1,), 1)[0].env}
    for name in sorted(devices - set(ENGINE_ENVIRONMENT)):
        log.warning("skyinfer.devices sets %s for an engine, which ENGINE_ENVIRONMENT does not describe", name)
    return list(ENGINE_ENVIRONMENT.values())


def environment_lines() -> Iterator[str]:
    def entries(variables: list[EnvVar]) -> Iterator[str]:
        for var in variables:
            yield f"``{var.name}``"
            yield f"   {var.where[:1].upper()}{var.where[1:]}: {var.meaning}."
            yield ""

    yield "Read by skyinfer"
    yield "----------------"
    yield ""
    options = [
        EnvVar(option.env, f"``skyinfer serve``, the default of ``{option.flag(field.name)}``", option.help)
        for field, option in cli_fields()
        if option.env
    ]
    also = {var.name: var for var in READ_ENVIRONMENT}
    for var in options:
        extra = also.pop(var.name, None)
        also_reads = f" {extra.where[:1].upper()}{extra.where[1:]}: {extra.meaning}." if extra else ""
        yield f"``{var.name}``"
        yield f"   {var.where[:1].upper()}{var.where[1:]}: {var.meaning}.{also_reads}"
        yield ""
    yield from entries(list(also.values()))
    yield "Set for the engines"
    yield "-------------------"
    yield ""
    yield (
        "Each engine process inherits the front's environment, with these added (replacing the front's own"
        " value, if it has one):"
    )
    yield ""
    yield from entries(_engine_environment())
    yield (
        "Every other variable reaches the engines as the front has it: vLLM's own (``VLLM_LOGGING_LEVEL``,"
        " ``VLLM_ENABLE_RESPONSES_API_STORE``, ...), Hugging Face's (``HF_TOKEN``, ``HF_HOME``) and torch's."
    )
    yield ""
    yield "Tools and tests"
    yield "---------------"
    yield ""
    yield from entries(TOOLS_ENVIRONMENT)


class _Generated(Directive):
    def lines(self) -> Iterator[str]:
        raise NotImplementedError

    # Whether the lines hold section titles (they then need a section to parse into).
    titled = False

    def run(self) -> list[nodes.Node]:
        container = nodes.section() if self.titled else nodes.container()
        nested_parse_with_titles(self.state, StringList(list(self.lines()), source="skyinfer"), container)
        return container.children


class RoutesDirective(_Generated):
    titled = True

    def lines(self) -> Iterator[str]:
        return _route_lines(front_routes())


class OptionsDirective(_Generated):
    def lines(self) -> Iterator[str]:
        return option_lines()


class MetricsDirective(_Generated):
    titled = True

    def lines(self) -> Iterator[str]:
        return metrics_lines()


class EnvironmentDirective(_Generated):
    titled = True

    def lines(self) -> Iterator[str]:
        return environment_lines()


def setup(app):
    app.add_directive("skyinfer-routes", RoutesDirective)
    app.add_directive("skyinfer-options", OptionsDirective)
    app.add_directive("skyinfer-metrics", MetricsDirective)
    app.add_directive("skyinfer-environment", EnvironmentDirective)
    return {"parallel_read_safe": True}
