"""Sphinx directives that write skyinfer's reference from the code itself, never by hand:

* ``.. skyinfer-routes::`` — every route the front registers (``create_app``'s own route table),
  grouped by the module that serves it, with the parameters its handler reads (``wire.takes``)
  and the first paragraph of its docstring;
* ``.. skyinfer-options::`` — every field of ``ServeConfig``, with its ``skyinfer serve`` flag,
  default and help where it is a command-line option.
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
from sphinx.util.nodes import nested_parse_with_titles

from skyinfer.app import create_app
from skyinfer.config import CLI, ServeConfig

# The modules that serve routes, in the order the reference shows them.
SECTIONS = {
    "skyinfer.proxy": "Data plane (one engine answers)",
    "skyinfer.sessions": "Data plane (one engine answers)",
    "skyinfer.vllm_routes": "vLLM's other routes, for the fleet",
    "skyinfer.control": "Control plane (every engine)",
    "skyinfer.weights.sync": "Weight transfer",
    "skyinfer.adapters": "LoRA adapters",
    "skyinfer.health": "Operations",
    "skyinfer.metrics": "Operations",
    "skyinfer.supervisor": "Operations",
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


def front_routes() -> list[Route]:
    """Every (method, path) the front registers, from the app ``create_app`` builds (no engine starts)."""
    with tempfile.TemporaryDirectory() as socket_dir:
        app = create_app(ServeConfig(model=socket_dir, device="cpu", socket_dir=socket_dir, adapter_dir=socket_dir))
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
        routes.append(
            Route(route.method, route.resource.canonical, handler.__module__, handler, doc.split("\n\n")[0], parameters)
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
            yield ""


# The fields ``skyinfer serve`` takes in its own way rather than as ``--<field name>``.
_OWN_WAY = {
    "model": "``--model PATH`` (a local directory or a Hugging Face name; without it, the built-in demo model)",
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
            yield f"``{cli.flag(field.name)}`` (``{field.name}``, {shown})"
            yield f"   {cli.help}"
        elif field.name in _OWN_WAY:
            yield f"``{field.name}`` ({shown})"
            yield f"   {_OWN_WAY[field.name]}"
        else:
            yield f"``{field.name}`` (Python only, {shown})"
            yield "   Set through ``ServeConfig`` (not a ``skyinfer serve`` flag)."
        yield ""


class _Generated(Directive):
    def lines(self) -> Iterator[str]:
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        container = nodes.section() if self.name == "skyinfer-routes" else nodes.container()
        nested_parse_with_titles(self.state, StringList(list(self.lines()), source="skyinfer"), container)
        return container.children


class RoutesDirective(_Generated):
    def lines(self) -> Iterator[str]:
        return _route_lines(front_routes())


class OptionsDirective(_Generated):
    def lines(self) -> Iterator[str]:
        return option_lines()


def setup(app):
    app.add_directive("skyinfer-routes", RoutesDirective)
    app.add_directive("skyinfer-options", OptionsDirective)
    return {"parallel_read_safe": True}
