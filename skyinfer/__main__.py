"""Command line: ``skyinfer serve`` and ``skyinfer demo-model``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

DEFAULT_DEMO_DIR = Path(os.environ.get("SKYINFER_CACHE", Path.home() / ".cache" / "skyinfer")) / "demo-model"

log = logging.getLogger("skyinfer")


def _serve_parser(sub) -> argparse.ArgumentParser:
    from .config import cli_fields

    p = sub.add_parser(
        "serve",
        help="start the service: N vLLM engines behind one OpenAI-compatible endpoint",
        description=(
            "Start N vLLM engine processes and serve them behind one HTTP endpoint. "
            "Any option not listed here is a vLLM engine argument and is passed to every "
            "engine as `vllm serve` takes it (e.g. --max-model-len 2048 --dtype float32)."
        ),
        allow_abbrev=False,
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        help=f"model directory or name (default: the built-in demo model, built in {DEFAULT_DEMO_DIR})",
    )
    groups = {None: p}
    for field, option in cli_fields():
        if option.group not in groups:
            groups[option.group] = p.add_argument_group(option.group)
        group, flags = groups[option.group], (option.flag(field.name), *option.aliases)
        if field.type == "bool":
            group.add_argument(*flags, dest=field.name, action="store_true", help=option.help)
            continue
        if field.type == "tuple[str, ...]":
            group.add_argument(
                *flags, dest=field.name, action="append", default=[], metavar=option.metavar, help=option.help
            )
            continue
        default = os.environ.get(option.env) if option.env else field.default
        shown = f"${option.env}" if option.env else field.default
        group.add_argument(
            *flags,
            dest=field.name,
            default=default,
            type=_ARG_TYPES[field.type],
            choices=option.choices,
            metavar=option.metavar,
            help=f"{option.help} (default: {shown})",
        )
    return p


# ServeConfig's annotations, as strings (postponed evaluation), to argument types; a field with a
# converter (--engine-sizes) takes the string as given, and ServeConfig says what is wrong with it.
_ARG_TYPES = {"int": int, "float": float, "str": str, "str | None": str, "tuple[tuple[int, int], ...] | None": str}


def _config_from_args(ns: argparse.Namespace, engine_args: list[str]):
    from .config import ServeConfig, cli_fields
    from .demo_model import ensure_demo_model

    model = ns.model
    if model is None:
        log.info("no --model given: using the demo model in %s", DEFAULT_DEMO_DIR)
        model = str(ensure_demo_model(DEFAULT_DEMO_DIR))
    options = {field.name: getattr(ns, field.name) for field, _ in cli_fields()}
    return ServeConfig(model=model, engine_args=tuple(engine_args), **options)


_EXAMPLES = """\
examples:
  skyinfer serve                                   the built-in demo model, 1 engine, on 127.0.0.1:8000
  skyinfer serve --model Qwen/Qwen3-8B --engines 4 -tp 2 --max-model-len 8192
  skyinfer status http://127.0.0.1:8000            a table of the engines
  skyinfer demo-model ./demo                       write the tiny demo checkpoint

Each command has its own --help (skyinfer serve --help).
"""


def _status_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "status",
        help="show a running server's engines: state, devices, weight version, requests in flight",
        description="Print one row per engine of the skyinfer server at URL (GET /engines). Exit code: 0 when"
        " every engine is ready, 3 when some are not, 1 when the server cannot be reached; --json or not.",
    )
    p.add_argument(
        "url", nargs="?", default="http://127.0.0.1:8000", help="server address (default: http://127.0.0.1:8000)"
    )
    p.add_argument(
        "--admin-key",
        default=os.environ.get("SKYINFER_ADMIN_KEY"),
        help="the server's admin key, if it has one (default: $SKYINFER_ADMIN_KEY)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print the raw JSON instead of a table (with the same exit code; {"error": ..., "url": ...} when'
        " the server cannot be reached)",
    )
    return p


def _status(args) -> int:
    """0 when every engine is ready, 3 when some are not, 1 when the server cannot be reached (or
    refuses): the same with ``--json``, which prints the view, or the error, as JSON."""
    import json

    from .admin.metrics import read_hit_rates
    from .client import Client, SkyinferError

    with Client(args.url, admin_key=args.admin_key, retries=0, timeout_s=30) as client:
        try:
            engines = client.engines()
            fleet = client.weight_info()["weight_version"]
            hit_rates = read_hit_rates(client.metrics())
        except SkyinferError as exc:
            print(f"skyinfer status: {args.url}: {exc.message}", file=sys.stderr)
            if args.json:
                print(json.dumps({"error": exc.message, "status": exc.status, "url": args.url}, indent=2))
            return 1
    for e in engines:
        e["prefix_cache_hit_rate"] = hit_rates.get(e["id"])
    if args.json:
        print(json.dumps({"weight_version": fleet, "engines": engines}, indent=2))
    else:
        print(format_engine_table(engines, fleet))
    return 0 if all(e["state"] == "ready" for e in engines) else 3


def format_engine_table(engines: list[dict], fleet_version: str | None) -> str:
    header = ("ENGINE", "STATE", "DEVICES", "WEIGHTS", "IN FLIGHT", "UNFINISHED", "PREFIX HITS", "RESTARTS", "PID")
    rows = [header]
    for e in engines:
        devices = e["devices"]
        rows.append(
            (
                str(e["id"]),
                e["state"],
                f"{devices['kind']}:{','.join(map(str, devices['ids']))}",
                str(e["weight_version"]),
                str(e["in_flight"]),
                str(e.get("unfinished_requests", "")),
                "-" if (rate := e.get("prefix_cache_hit_rate")) is None else f"{rate:.0%}",
                str(e.get("restarts", 0)),
                str(e["pid"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(f"fleet weight version: {fleet_version or 'as loaded'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="skyinfer",
        description="Serve vLLM engines for RL post-training: one OpenAI-compatible endpoint, "
        "sticky sessions, pause/resume/sleep, and weight transfer from a trainer.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,status,demo-model}")
    _serve_parser(sub)
    _status_parser(sub)
    demo = sub.add_parser("demo-model", help="write the tiny built-in demo model (Qwen2, BPE tokenizer) to DIR")
    demo.add_argument("dir", help="output directory")

    args, extra = parser.parse_known_args(argv)
    if args.command != "serve" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "status":
        return _status(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "demo-model":
        from .demo_model import build_demo_model

        print(build_demo_model(args.dir))
        return 0
    import uvloop

    try:
        config = _config_from_args(args, extra)
    except ValueError as exc:  # attrs validators and the bind rule
        parser.error(str(exc))
    from .front.service import run_service
    from .ranks import LayoutError

    # uvloop's transports cut the front's per-chunk cost of relaying streams.
    try:
        return uvloop.run(run_service(config))
    except LayoutError as exc:  # the engines do not fit this machine: refused before any starts
        parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
