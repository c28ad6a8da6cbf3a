"""``.. skyinfer-benchmark:: NAME``: one question of the benchmarks page, its table and its plot,
drawn from the recorded runs in ``docs/benchmarks/`` by ``tools/render_benchmarks.py``.

When the build starts, the plots are drawn into ``docs/_static/benchmarks/`` (not committed; only
those older than the data or the renderer); the directive writes the question's table (an rst
``list-table``) and the plot's image, and tells Sphinx the page depends on the data.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList
from sphinx.util.nodes import nested_parse_with_titles

RENDERER = Path(__file__).resolve().parents[2] / "tools" / "render_benchmarks.py"
PLOTS = "_static/benchmarks"


def renderer():
    """``tools/render_benchmarks.py`` as a module (``tools/`` is no package)."""
    module = sys.modules.get("render_benchmarks")
    if module is None:
        spec = importlib.util.spec_from_file_location("render_benchmarks", RENDERER)
        module = importlib.util.module_from_spec(spec)
        sys.modules["render_benchmarks"] = module
        spec.loader.exec_module(module)
    return module


class BenchmarkDirective(Directive):
    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        render = renderer()
        name = self.arguments[0]
        if name not in render.QUESTIONS:
            raise self.error(f"no benchmark {name!r}; known: {', '.join(render.QUESTIONS)}")
        env = self.state.document.settings.env
        for path in render.inputs():
            env.note_dependency(str(path))
        lines = render.table_rst(name)
        question = render.QUESTIONS[name]
        if question.plot is not None:
            lines += ["", f".. image:: /{PLOTS}/{name}.png", f"   :alt: {question.alt}", "   :width: 100%"]
        container = nodes.container(classes=["skyinfer-benchmark"])
        nested_parse_with_titles(self.state, StringList(lines, source=f"<skyinfer-benchmark {name}>"), container)
        return [container]


def draw_plots(app) -> None:
    renderer().render(Path(app.srcdir) / PLOTS, stale_only=True)


def setup(app):
    app.add_directive("skyinfer-benchmark", BenchmarkDirective)
    app.connect("builder-inited", draw_plots)
    return {"parallel_read_safe": True}
