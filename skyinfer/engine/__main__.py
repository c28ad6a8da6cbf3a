"""Engine child process: ``python -m skyinfer.engine --socket PATH -- <vllm serve arguments>``.

The front starts one of these per engine, with the device environment
(``CUDA_VISIBLE_DEVICES`` or ``VLLM_CPU_OMP_THREADS_BIND``) already set.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys


def parse_engine_args(vllm_argv: list[str]):
    """Parse arguments exactly as ``vllm serve`` does."""
    from .vllm_api import FlexibleArgumentParser, make_arg_parser, validate_parsed_serve_args

    parser = make_arg_parser(FlexibleArgumentParser(prog="skyinfer engine"))
    args = parser.parse_args(vllm_argv)
    if args.model_tag is not None:
        args.model = args.model_tag
    validate_parsed_serve_args(args)
    return args


def set_up_process(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Take the engine's own arguments (those before ``--``) and set its process up by them: its
    output relayed, its life tied to the front's, its cores pinned. Returns them and vLLM's
    arguments. The front's fake engine (tools/fake_engine.py) starts the same way."""
    own = argparse.ArgumentParser(prog="python -m skyinfer.engine")
    own.add_argument("--socket", required=True, help="Unix socket to serve on once the engine is ready")
    own.add_argument("--cpus", help="comma-separated cores this engine (and every process it starts) may run on")
    own.add_argument(
        "--lifeline-fd", type=int, help="read end of the front's lifeline pipe: the process group dies at its end"
    )
    own.add_argument("--output-tail", help="relay the engine's output to its stderr, keeping its end in this file")
    own.add_argument("--log-prefix", default="", help="with --output-tail: written before every line of the output")
    split = argv.index("--") if "--" in argv else len(argv)
    own_argv, vllm_argv = argv[:split], argv[split + 1 :]
    ns = own.parse_args(own_argv)
    if ns.output_tail is not None:
        # First, while this process has no thread: the relay is a fork of it.
        from .output import relay_output

        relay_output(ns.log_prefix, ns.output_tail)
    if ns.lifeline_fd is not None:
        # Before vLLM: the front may die during its long start-up too.
        from .lifeline import die_with_front

        die_with_front(ns.lifeline_fd)
    if ns.cpus:
        # Inherited by vLLM's EngineCore and workers: a busy engine cannot
        # starve another engine's control path of CPU.
        os.sched_setaffinity(0, {int(c) for c in ns.cpus.split(",")})
    return ns, vllm_argv


def main(argv: list[str] | None = None) -> None:
    ns, vllm_argv = set_up_process(sys.argv[1:] if argv is None else argv)

    # vLLM's app behind the engine registers its dev routes (/server_info,
    # /collective_rpc, ...) only in dev mode; the engine's socket is the
    # front's alone, and the front decides which of them users may call.
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    from .vllm_api import cli_env_setup, configure_logging_from_args

    cli_env_setup()
    args = parse_engine_args(vllm_argv)
    configure_logging_from_args(args)

    import uvloop

    from .server import serve_engine

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve_engine(ns.socket, args))


if __name__ == "__main__":
    main()
