"""Engine child process: ``python -m skyinfer.engine --socket PATH -- <vllm serve arguments>``. The
front starts one per engine, with the device environment (``CUDA_VISIBLE_DEVICES`` or
``VLLM_CPU_OMP_THREADS_BIND``) already set."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import sys
from collections.abc import Callable

from ..engine_wire import STACKS_SIGNAL

__all__ = ["import_engine", "main", "parse_engine_args", "set_up_process"]


def parse_engine_args(vllm_argv: list[str]):
    """Parse arguments exactly as ``vllm serve`` does."""
    from ..vllm_api import FlexibleArgumentParser, make_arg_parser, validate_parsed_serve_args

    parser = make_arg_parser(FlexibleArgumentParser(prog="skyinfer engine"))
    # vLLM's default for --log-error-stack is its dev mode, which the engine turns on for the dev
    # routes alone (_dev_mode): `vllm serve`'s default is off. On, every refused request's whole
    # exception is logged on the event loop, and one body whose list fails a union field (158,601
    # validation errors, each echoing its input) held an engine's loop past its health probes.
    parser.set_defaults(log_error_stack=False)
    args = parser.parse_args(vllm_argv)
    if args.model_tag is not None:
        args.model = args.model_tag
    validate_parsed_serve_args(args)
    return args


def set_up_process(argv: list[str], warm_up: Callable[[], None] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """Take the engine's own arguments (those before ``--``) and set its process up by them: its
    output relayed, its life tied to the front's, its cores pinned. Returns them and vLLM's
    arguments. The front's fake engine (tools/fake_engine.py) starts the same way.

    With ``--standby`` the process is a spare (standby.py): it runs ``warm_up`` (the imports an
    engine needs), waits for the front's start order, and then sets itself up as above."""
    own = argparse.ArgumentParser(prog="python -m skyinfer.engine")
    own.add_argument("--socket", required=True, help="Unix socket to serve on once the engine is ready")
    own.add_argument("--cpus", help="comma-separated cores this engine (and every process it starts) may run on")
    own.add_argument(
        "--lifeline-fd", type=int, help="read end of the front's lifeline pipe: the process group dies at its end"
    )
    own.add_argument("--output-tail", help="relay the engine's output to its stderr, keeping its end in this file")
    own.add_argument("--log-prefix", default="", help="with --output-tail: written before every line of the output")
    own.add_argument(
        "--standby",
        action="store_true",
        help="start as a spare: import what an engine needs, then wait for the start order on stdin",
    )
    own.add_argument("--report-fd", type=int, help="with --standby: where the spare says that it stands by")
    own.add_argument(
        "--loaded",
        action="store_true",
        help="with --standby: build the whole engine (model loaded, KV cache) before standing by",
    )
    split = argv.index("--") if "--" in argv else len(argv)
    own_argv, vllm_argv = argv[:split], argv[split + 1 :]
    ns = own.parse_args(own_argv)
    ns.spare = None
    if ns.standby:
        # Its lifeline is watched from the start; its relay and cores are set up below, as a cold
        # engine's (a loaded spare's relay is the spare's, which goes on as the engine's).
        from .standby import stand_by

        ns.spare = stand_by(ns, warm_up or (lambda: None))
    if ns.output_tail is not None and not ns.loaded:
        # First, while this process has no thread: the relay is a fork of it. (A spare has two by
        # now, its lifeline's and torch's, blocked in calls that hold nothing the relay uses.)
        from .output import relay_output

        relay_output(ns.log_prefix, ns.output_tail)
    # On the front's signal, every thread's stack to the output (the relay's pipe by now), written by
    # faulthandler's C handler: it is written even while the event loop, or C code, holds the GIL.
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    if ns.lifeline_fd is not None and not ns.standby:
        # Before vLLM: the front may die during its long start-up too.
        from .lifeline import die_with_front

        die_with_front(ns.lifeline_fd)
    if ns.cpus:
        # Inherited by vLLM's EngineCore and workers: a busy engine cannot
        # starve another engine's control path of CPU.
        cores = {int(c) for c in ns.cpus.split(",")}
        os.sched_setaffinity(0, cores)
        # Threads already running too (a spare's: its lifeline's, torch's), as if started after.
        for thread_id in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(thread_id), cores)
    return ns, vllm_argv


# What the engine's start-up takes from vllm_api: main's, parse_engine_args', serve_engine's and
# the serving routes' (create_engine_app). A spare imports them all before it waits.
_START_UP_NAMES = (
    "cli_env_setup",
    "configure_logging_from_args",
    "FlexibleArgumentParser",
    "make_arg_parser",
    "validate_parsed_serve_args",
    "build_async_engine_client",
    "build_app",
    "init_app_state",
    "ChatCompletionRequest",
    "CompletionRequest",
    "GenerateRequest",
    "TokenizeRequest",
    "DetokenizeRequest",
)


def _dev_mode() -> None:
    # vLLM's app behind the engine registers its dev routes (/server_info,
    # /collective_rpc, ...) only in dev mode; the engine's socket is the
    # front's alone, and the front decides which of them users may call.
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"


def import_engine() -> None:
    """A spare's warm-up (standby.py): torch, vLLM, its engine client and OpenAI serving modules,
    and this package's engine modules, as a cold engine imports them on its way to the socket;
    nothing is built, no device touched (neither torch's nor vLLM's import initialises CUDA)."""
    _dev_mode()
    _choose_platform()
    from .. import vllm_api

    for name in _START_UP_NAMES:
        getattr(vllm_api, name)
    import uvloop  # noqa: F401

    from . import server  # noqa: F401


def _choose_platform() -> None:
    # Before vLLM's parser or engine resolves the platform; after the output relay's fork, which
    # is made while the process has no thread (torch's import starts one).
    from .cpu_platform import fork_engine_processes_on_cpu

    fork_engine_processes_on_cpu()


def main(argv: list[str] | None = None) -> None:
    ns, vllm_argv = set_up_process(sys.argv[1:] if argv is None else argv, warm_up=import_engine)

    _dev_mode()
    _choose_platform()
    from ..vllm_api import cli_env_setup, configure_logging_from_args

    cli_env_setup()
    args = parse_engine_args(vllm_argv)
    configure_logging_from_args(args)

    import uvloop

    from .server import serve_engine

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve_engine(ns.socket, args, ns.spare if ns.loaded else None))


if __name__ == "__main__":
    main()
