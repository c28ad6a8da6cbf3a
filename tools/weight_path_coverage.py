#!/usr/bin/env python
"""What the CPU suite executes of the weight path, measured in every process it runs: the front,
each engine, its EngineCore and workers (forked or not), the trainers and clients. coverage.py
starts in each Python process whose environment names its configuration (``COVERAGE_PROCESS_START``;
coverage's own ``.pth`` hook), restarts in each forked child (``patch = fork``) and saves at any
exit it can (``patch = _exit``, ``sigterm``). An EngineCore, where the workers of a one-worker
engine run, is killed soon after its engine ends: so a SIGTERM handler any measured process
installs (an engine's) first saves coverage's data and has its Python descendants save theirs (a
``.pth`` hook this tool puts in the environment for the run, and takes out after). A process killed
with SIGKILL alone (the fault tests' victims) saves nothing; the rest of the suite runs what it ran.

    .venv/bin/python tools/weight_path_coverage.py                    # tools/run-tests, then the report
    .venv/bin/python tools/weight_path_coverage.py -- -k "nccl or ipc"  # pytest's arguments after --
    .venv/bin/python tools/weight_path_coverage.py --report DIR        # the report of an earlier run

The weight path: ``skyinfer/transfer/``, ``skyinfer/weights/`` and the engine's weight modules
(``WEIGHT_PATH``). Prints each file's statements executed, then every function no process executed
(its name and first line): what only a GPU runs, or nothing does. ``DIR/coverage.json`` holds the
same. Not a CI gate: the suite runs about 1.5 times as long under measurement.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WEIGHT_PATH = (
    "skyinfer/transfer/",
    "skyinfer/weights/",
    "skyinfer/engine/backends.py",
    "skyinfer/engine/catchup_files.py",
    "skyinfer/engine/cpu_setup.py",
    "skyinfer/engine/staging.py",
    "skyinfer/engine/targets.py",
    "skyinfer/engine/weights.py",
    "skyinfer/engine/worker_extension.py",
)

SAVER_PTH = "zz_skyinfer_coverage_saver.pth"
# Run by the site module at every interpreter start, after coverage's own a1_coverage.pth. Every
# measured process saves its data on SAVE_SIGNAL; a SIGTERM handler any of them installs (the
# engine's, vLLM's EngineCore's) first saves its own data and has its Python descendants save
# theirs, then runs: a process's children are SIGKILLed soon after it ends (vLLM's EngineCore, where
# the workers of a one-worker engine run, by its engine), and so lose nothing.
SAVER = "import sys; exec({!r}, {{}})".format(
    "import os\n"
    "if os.getenv('SKYINFER_COVERAGE_ON_SIGTERM'):\n"
    " import signal, time, coverage\n"
    " SAVE_SIGNAL = signal.SIGRTMIN + 5\n"
    " install = signal.signal\n"
    " def save(*_):\n"
    "  cov = coverage.Coverage.current()\n"
    "  if cov is not None:\n"
    "   try:\n"
    "    cov.save()\n"
    "   except Exception:\n"
    "    pass\n"
    " def python_descendants(pid):\n"
    "  found = []\n"
    "  try:\n"
    "   tasks = os.listdir(f'/proc/{pid}/task')\n"
    "  except OSError:\n"
    "   return found\n"
    "  for task in tasks:\n"
    "   try:\n"
    "    children = open(f'/proc/{pid}/task/{task}/children').read().split()\n"
    "   except OSError:\n"
    "    continue\n"
    "   for child in map(int, children):\n"
    "    try:\n"
    "     if 'python' in os.readlink(f'/proc/{child}/exe'):\n"
    "      found.append(child)\n"
    "    except OSError:\n"
    "     continue\n"
    "    found += python_descendants(child)\n"
    "  return found\n"
    " def saving_first(handler):\n"
    "  def on_sigterm(signum, frame):\n"
    "   save()\n"
    "   descendants = python_descendants(os.getpid())\n"
    "   for pid in descendants:\n"
    "    try:\n"
    "     os.kill(pid, SAVE_SIGNAL)\n"
    "    except OSError:\n"
    "     pass\n"
    "   if descendants:\n"
    "    time.sleep(0.5)\n"
    "   return handler(signum, frame)\n"
    "  return on_sigterm\n"
    " def chained(signum, handler):\n"
    "  if signum == signal.SIGTERM and callable(handler):\n"
    "   handler = saving_first(handler)\n"
    "  return install(signum, handler)\n"
    " install(SAVE_SIGNAL, save)\n"
    " signal.signal = chained\n"
)

RCFILE = """\
[run]
parallel = true
data_file = {data}
source = skyinfer
patch =
    fork
    _exit
sigterm = true
"""


def weight_path_files() -> list[Path]:
    files = []
    for entry in WEIGHT_PATH:
        path = ROOT / entry
        files += sorted(path.glob("*.py")) if entry.endswith("/") else [path]
    return files


def run_suite(out: Path, pytest_args: list[str]) -> int:
    """tools/run-tests with every Python process measured; its exit status."""
    out.mkdir(parents=True, exist_ok=True)
    rcfile = out / "coveragerc"
    rcfile.write_text(RCFILE.format(data=out / ".coverage"))
    subprocess.run([str(ROOT / "tools" / "bootstrap")], cwd=ROOT, check=True)  # the environment, with coverage
    site_packages = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    saver = Path(site_packages) / SAVER_PTH
    saver.write_text(SAVER + "\n")
    env = {**os.environ, "COVERAGE_PROCESS_START": str(rcfile), "SKYINFER_COVERAGE_ON_SIGTERM": "1"}
    try:
        return subprocess.run([str(ROOT / "tools" / "run-tests"), *pytest_args], cwd=ROOT, env=env).returncode
    finally:
        saver.unlink()


def _declares_only(body: list[ast.stmt]) -> bool:
    """A body with nothing to run: ``...``, ``pass`` or ``raise NotImplementedError`` (a protocol's
    or a base class's declaration)."""
    for statement in body:
        if isinstance(statement, ast.Pass) or (
            isinstance(statement, ast.Expr)
            and isinstance(statement.value, ast.Constant)
            and statement.value.value is ...
        ):
            continue
        raised = statement.exc if isinstance(statement, ast.Raise) else None
        if isinstance(raised, ast.Call):
            raised = raised.func
        if not (isinstance(raised, ast.Name) and raised.id == "NotImplementedError"):
            return False
    return True


def functions(path: Path) -> list[tuple[str, int, set[int]]]:
    """Each function of a module that has something to run (methods and nested ones too; not a
    protocol's or base class's declaration): its qualified name, first line, and the lines of its
    own statements (not its docstring's, not a nested function's)."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                body = child.body[1:] if ast.get_docstring(child) is not None else child.body
                if _declares_only(body):
                    visit(child, f"{name}.")
                    continue
                lines = set()
                for statement in body:
                    for sub in ast.walk(statement):
                        if (
                            isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                            and sub is not statement
                        ):
                            continue
                        if isinstance(sub, ast.stmt):
                            lines.add(sub.lineno)
                found.append((name, child.lineno, lines))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return found


def report(out: Path) -> dict:
    import coverage

    cov = coverage.Coverage(data_file=str(out / ".coverage"), config_file=str(out / "coveragerc"))
    cov.combine(keep=True, data_paths=[str(out)])
    cov.load()
    executed = cov.get_data()
    result = {"files": {}, "not_executed": []}
    total_statements = total_run = 0
    for path in weight_path_files():
        _, statements, _, missing, _ = cov.analysis2(str(path))
        ran = set(statements) - set(missing)
        relative = str(path.relative_to(ROOT))
        result["files"][relative] = {
            "statements": len(statements),
            "executed": len(ran),
            "not_executed": cov._analyze(str(path)).missing_formatted(),
        }
        total_statements += len(statements)
        total_run += len(ran)
        lines_run = set(executed.lines(str(path)) or ())
        for name, first, lines in functions(path):
            if lines and not lines & lines_run:
                result["not_executed"].append({"file": relative, "function": name, "line": first})
    result["statements"], result["executed"] = total_statements, total_run
    return result


def print_report(result: dict) -> None:
    print(f"{'file':48s} {'statements':>10s} {'executed':>9s} {'%':>6s}  lines not executed")
    for name, figures in result["files"].items():
        share = 100 * figures["executed"] / max(figures["statements"], 1)
        print(
            f"{name:48s} {figures['statements']:10d} {figures['executed']:9d} {share:6.1f}  {figures['not_executed']}"
        )
    share = 100 * result["executed"] / max(result["statements"], 1)
    print(f"{'the weight path':48s} {result['statements']:10d} {result['executed']:9d} {share:6.1f}")
    print(f"\nfunctions no process of the suite executed ({len(result['not_executed'])}):")
    for entry in result["not_executed"]:
        print(f"  {entry['file']}:{entry['line']}  {entry['function']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="where the data and coverage.json go (default: a new temporary folder)")
    p.add_argument("--report", type=Path, metavar="DIR", help="report an earlier run's data, running nothing")
    p.add_argument("pytest_args", nargs="*", help="after --: passed to tools/run-tests")
    args = p.parse_args()
    out = args.report or args.out or Path(tempfile.mkdtemp(prefix="skyinfer-coverage-"))
    status = 0 if args.report else run_suite(out, args.pytest_args)
    result = report(out)
    (out / "coverage.json").write_text(json.dumps(result, indent=1))
    print_report(result)
    print(f"\ndata: {out} (the suite exited {status})", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
