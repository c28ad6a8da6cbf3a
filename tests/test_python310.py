"""skyinfer imports on the oldest Python it claims (setup.cfg: python_requires >= 3.10).

CUDA images often ship 3.10, which lacks names the newer standard library has (``typing.Self``
among them). tools/bootstrap puts the front's dependencies into .venv-py310 when the machine
has a Python 3.10; this test runs that interpreter.
"""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON310 = ROOT / ".venv-py310" / "bin" / "python"

# Run by Python 3.10: import every module; one that needs the engine's or the trainer's stack
# (not in .venv-py310) is checked statically instead: each name it takes from the standard
# library must exist in 3.10's, and the file must compile under 3.10.
CHECK = r"""
import ast, importlib, pkgutil, sys
import skyinfer

HEAVY = {"torch", "vllm", "numpy", "transformers"}
imported, static, problems = [], [], []
for info in pkgutil.walk_packages(skyinfer.__path__, "skyinfer."):
    try:
        importlib.import_module(info.name)
        imported.append(info.name)
        continue
    except ModuleNotFoundError as exc:
        if exc.name.split(".")[0] not in HEAVY:
            problems.append(f"{info.name}: {exc!r}")
            continue
    except Exception as exc:
        problems.append(f"{info.name}: {exc!r}")
        continue
    static.append(info.name)
    path = importlib.util.find_spec(info.name).origin
    tree = ast.parse(open(path).read(), path)
    compile(tree, path, "exec")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in sys.stdlib_module_names:
            module = importlib.import_module(node.module)
            problems += [f"{info.name}: {node.module}.{a.name} is not in Python 3.10" for a in node.names if not hasattr(module, a.name)]
print(sys.version_info[:2], len(imported), len(static))
print("\n".join(problems))
"""


@pytest.mark.skipif(
    not PYTHON310.exists(),
    reason="this machine has no Python 3.10 (tools/bootstrap makes .venv-py310 where it has one)",
)
def test_skyinfer_imports_on_python_310():
    done = subprocess.run([PYTHON310, "-c", CHECK], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    version, *problems = done.stdout.strip().splitlines()
    assert version.startswith("(3, 10) ")
    imported, static = map(int, version.split(") ")[1].split())
    # The front (app, supervisor, routes, client) imports for real; the trainer and engine
    # modules, which need torch and vLLM, are checked name by name.
    assert imported >= 30 and static >= 5, version
    assert problems == [], problems
