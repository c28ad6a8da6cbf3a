"""Sphinx configuration: ``sphinx-build -W -b html docs docs/_build/html`` (``.ci/run`` builds it)."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "_ext")))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

project = "skyinfer"
author = "the skyinfer developers"
extensions = ["sphinx.ext.autodoc", "skyinfer_reference", "skyinfer_benchmarks"]
# _static/benchmarks/: the benchmarks' plots (and, by hand, tables) tools/render_benchmarks.py draws.
exclude_patterns = ["_build", "_static/benchmarks"]
html_theme = "alabaster"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# The client and trainers import no vLLM; the engine-side modules are not documented here.
nitpicky = False
