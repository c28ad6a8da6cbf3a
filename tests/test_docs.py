"""The documentation builds with no warning, and its reference is the code's own: exactly the
routes the front registers and exactly ``ServeConfig``'s fields. The README stays a front page."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import attrs

from skyinfer.config import ServeConfig

from support import app_routes

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_build_and_their_reference_is_exactly_the_code(demo_model, tmp_path):
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-E",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "text",
            str(ROOT / "docs"),
            str(tmp_path / "text"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    routes = (tmp_path / "text" / "reference" / "route-table.txt").read_text()
    # Each entry's term: the unindented lines that name its routes (the docstring below is indented).
    terms = re.findall(r'^"[A-Z]+.*?(?=\n   )', routes, re.M | re.S)
    documented = {pair for term in terms for pair in re.findall(r'"(GET|POST|PUT|PATCH|DELETE)\s+(/[^"\s]*)"', term)}
    assert documented == app_routes(demo_model, tmp_path / "sockets")
    options = (tmp_path / "text" / "reference" / "options.txt").read_text()
    fields = set(re.findall(r'^"--[a-z-]+" \("([a-z_]+)"', options, re.M)) | set(
        re.findall(r'^"([a-z_]+)" \(', options, re.M)
    )
    assert fields == {field.name for field in attrs.fields(ServeConfig)}


def test_the_readme_is_a_front_page():
    readme = (ROOT / "README.rst").read_text()
    assert len(readme.splitlines()) <= 300
    # Its two set-up commands, and both shapes of the RL loop, as code.
    assert "tools/run-demo" in readme and "tools/run-tests" in readme
    assert "GlooTrainer" in readme and "SharedMemoryTrainer" in readme and 'wake_up(tags=["weights"])' in readme
