"""The documentation builds with no warning, and its reference is the code's own: exactly the
routes the front registers and exactly ``ServeConfig``'s fields, every ``skyinfer serve`` option,
every metric ``/metrics`` exports, every public method of the client and the trainers, every
environment variable the code reads or sets. The README stays a front page, and each of its
figures has its source in ``docs/benchmarks.rst``. ``docs/protocols.rst`` names only files and names
that exist, and every side of a protocol between processes and every patch of vLLM the code has."""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from aiohttp.test_utils import make_mocked_request
from fakes import serve_fakes
from prometheus_client.parser import text_string_to_metric_families

from skyinfer import devices
from skyinfer.__main__ import _serve_parser
from skyinfer.client import AsyncClient, Client, MultiNodeClient, SkyinferError
from skyinfer.config import ServeConfig, cli_fields
from skyinfer.devices import parse_visible_devices, split_gpus
from skyinfer.front.app import create_app
from skyinfer.trainer import GlooTrainer, IPCTrainer, SharedMemoryTrainer

from support import app_routes

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The docs, built once as text (``-W``: a warning fails the build)."""
    out = tmp_path_factory.mktemp("docs") / "text"
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q", "-b", "text", str(DOCS), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def _unwrap(text: str) -> str:
    """Text the text builder wrapped (at a space, or after a hyphen), on one line again."""
    return " ".join(re.sub(r"-\n\s*", "-", text).split())


def _terms(page: str) -> list[str]:
    """A built text page's definition terms, unwrapped: the unindented lines an indented paragraph follows."""
    return [_unwrap(term) for term in re.findall(r"^(\S[^\n]*(?:\n\S[^\n]*)*)\n   \S", page, re.M)]


def test_the_docs_build_and_their_reference_is_exactly_the_code(built, demo_model, tmp_path):
    routes = (built / "reference" / "route-table.txt").read_text()
    # Each entry's term: the unindented lines that name its routes (the docstring below is indented).
    terms = re.findall(r'^"[A-Z]+.*?(?=\n   )', routes, re.M | re.S)
    documented = {pair for term in terms for pair in re.findall(r'"(GET|POST|PUT|PATCH|DELETE)\s+(/[^"\s]*)"', term)}
    assert documented == app_routes(demo_model, tmp_path / "sockets")
    options = (built / "reference" / "options.txt").read_text()
    fields = set(re.findall(r'^"-[-a-z]+"(?:, "-[-a-z]+")* \("([a-z_]+)"', options, re.M)) | set(
        re.findall(r'^"([a-z_]+)" \(', options, re.M)
    )
    assert fields == {field.name for field in attrs.fields(ServeConfig)}


# -- skyinfer serve's options --------------------------------------------------------------------


def serve_flags() -> set[str]:
    """Every option string ``skyinfer serve``'s own parser takes (its ``--help`` aside)."""
    serve = _serve_parser(argparse.ArgumentParser().add_subparsers())
    return {flag for action in serve._actions for flag in action.option_strings} - {"-h", "--help"}


def test_every_serve_option_has_a_reference_entry(built):
    """Each flag and each other spelling of it (``-tp``) starts an entry of the options reference,
    and an option whose default comes from the environment names its variable there."""
    options = (built / "reference" / "options.txt").read_text()
    entries = _terms(options)
    documented = {flag for term in entries for flag in re.findall(r'"(-{1,2}[a-z][-a-z]*)"', term.split(" (")[0])}
    assert sorted(serve_flags() - documented) == []
    for field, option in cli_fields():
        if option.env:
            entry = next(term for term in entries if f'"{option.flag(field.name)}"' in term)
            assert f'"${option.env}"' in entry, f"{option.flag(field.name)}: its variable {option.env} is not said"


# -- metrics ---------------------------------------------------------------------------------------


async def exported_metrics(tmp_path) -> dict[str, tuple[str, str, set[str]]]:
    """What ``GET /metrics`` exports of skyinfer's own, from the route itself on the app ``create_app``
    builds (no engine up, so no ``vllm:`` metric): name as scraped -> (type, help, labels seen)."""
    app = create_app(
        ServeConfig(model=str(tmp_path), device="cpu", socket_dir=str(tmp_path), adapter_dir=str(tmp_path))
    )
    view = next(r.handler for r in app.router.routes() if r.method == "GET" and r.resource.canonical == "/metrics")
    text = (await view(make_mocked_request("GET", "/metrics", app=app))).body.decode()
    metrics = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue  # prometheus_client's own series beside a counter or histogram
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = {label for sample in family.samples for label in sample.labels} - {"le"}
        metrics[name] = (family.type, family.documentation, labels)
    return metrics


async def test_every_exported_metric_has_a_reference_entry(built, tmp_path):
    """The metrics reference is generated (``.. skyinfer-metrics::``) and holds every metric the
    route exports, no other, each with its help text, type and labels."""
    assert ".. skyinfer-metrics::" in (DOCS / "reference" / "metrics.rst").read_text()
    page = (built / "reference" / "metrics.txt").read_text()
    entries = dict(re.findall(r'^"(skyinfer_[a-z_]+)"\n((?:   [^\n]*\n|\n)+)', page, re.M))
    exported = await exported_metrics(tmp_path)
    assert exported, "no metric exported"
    assert sorted(entries) == sorted(exported)
    for name, (kind, help_text, labels) in exported.items():
        entry = _unwrap(entries[name])
        assert help_text.strip(), f"{name} has no help text"
        assert " ".join(help_text.split())[1:] in entry, f"{name}: its help text is not in its entry"
        assert f"*Type:* {kind}" in entry, f"{name}: its type ({kind}) is not in its entry"
        for label in labels:
            assert f'"{label}"' in entry, f"{name}: its label {label} is not in its entry"
    assert "vllm:" in page  # the engines' own metrics, passed through labelled by engine


# -- the Python client and trainers ------------------------------------------------------------------

PUBLIC_CLASSES = (Client, AsyncClient, MultiNodeClient, SkyinferError, GlooTrainer, SharedMemoryTrainer, IPCTrainer)


def public_members(cls: type) -> dict[str, object]:
    """The public methods and properties a class has from skyinfer's code (its own and inherited)."""
    members: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("skyinfer"):
            for name, value in vars(klass).items():
                if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
                    members[name] = value
    return members


def test_every_public_client_and_trainer_method_is_in_the_python_reference(built):
    page = (built / "reference" / "python.txt").read_text()
    blocks = re.split(r"^(?:class|exception) ", page, flags=re.M)[1:]
    documented = {}
    for block in blocks:
        qualified = block.split("(", 1)[0]
        members = re.findall(r"^   (?:async )?([a-z_]\w*)\(.*\)$|^   property ([a-z_]\w*)\b", block, re.M)
        documented[qualified.rsplit(".", 1)[1]] = {method or prop for method, prop in members}
    missing, undocumented = [], []
    for cls in PUBLIC_CLASSES:
        for name, member in public_members(cls).items():
            if name not in documented.get(cls.__name__, set()):
                missing.append(f"{cls.__name__}.{name}")
            if not inspect.getdoc(member):
                undocumented.append(f"{cls.__name__}.{name}")
    assert missing == [], "not in docs/reference/python.rst's output"
    assert undocumented == [], "no docstring"


# -- environment variables ---------------------------------------------------------------------------

# How code names a variable it reads or sets (Python), or reads (the tools' shell scripts).
_ENV_IN_PYTHON = (
    r'environ(?:\.get)?\(\s*"([A-Z][A-Z0-9_]*)"',
    r'environ\[\s*"([A-Z][A-Z0-9_]*)"\s*\]',
    r'getenv\(\s*"([A-Z][A-Z0-9_]*)"',
    r'\benv\[\s*"([A-Z][A-Z0-9_]*)"\s*\]',
    r'\benv="([A-Z][A-Z0-9_]*)"',
    # Keys of the environments built for child processes, and any other literal of these families.
    r'"((?:SKYINFER|VLLM|CUDA|PYTHON|HF|OMP|NCCL|TORCH|FAKE_ENGINE)[A-Z0-9_]*)"',
)
_ENV_IN_SHELL = (r"\$\{?([A-Z][A-Z0-9_]*)",)
# The shell's own.
_STANDARD = {"HOME", "PATH"}


def environment_variables() -> dict[str, set[str]]:
    """Every variable named in ``skyinfer/`` and ``tools/``: name -> the files that name it."""
    found: dict[str, set[str]] = {}
    files = [*(ROOT / "skyinfer").rglob("*.py"), *(p for p in (ROOT / "tools").iterdir() if p.is_file())]
    for path in files:
        if path.suffix not in (".py", ""):
            continue
        text = path.read_text()
        for pattern in _ENV_IN_PYTHON if path.suffix == ".py" else _ENV_IN_SHELL:
            for name in re.findall(pattern, text):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return {name: files for name, files in found.items() if name not in _STANDARD}


def test_every_environment_variable_has_a_reference_entry(built):
    assert ".. skyinfer-environment::" in (DOCS / "reference" / "environment.rst").read_text()
    page = (built / "reference" / "environment.txt").read_text()
    documented = set(re.findall(r'^"([A-Z][A-Z0-9_]*)"$', page, re.M))
    variables = environment_variables()
    assert {"SKYINFER_API_KEY", "SKYINFER_ADMIN_KEY", "CUDA_VISIBLE_DEVICES", "VLLM_CPU_KVCACHE_SPACE"} <= set(
        variables
    )
    assert {name: sorted(files) for name, files in variables.items() if name not in documented} == {}


# -- the README ---------------------------------------------------------------------------------------


def test_the_readme_is_a_front_page():
    readme = (ROOT / "README.rst").read_text()
    assert len(readme.splitlines()) <= 300
    # Its two set-up commands, and both shapes of the RL loop, as code.
    assert "tools/run-demo" in readme and "tools/run-tests" in readme
    assert "GlooTrainer" in readme and "SharedMemoryTrainer" in readme and 'wake_up(tags=["weights"])' in readme


_NUMBER = r"\d+(?:[.,]\d+)*"
# A figure: a number, or a range of two, with its unit.
_FIGURE = re.compile(
    rf"(?<![\w.,/-])(?P<number>{_NUMBER}(?:\s?(?:-|–|to)\s?{_NUMBER})?)"
    r"(?P<unit>x|\s?(?:µs|us|ms|s|%|events/s|requests/s|tokens/s|t/s|GiB|MiB/s|MiB|minutes|seconds|hours))"
    r"(?![\w/])"
)


def _prose(rst: str) -> Iterator[tuple[int, str]]:
    """The lines outside code blocks (``.. code-block::``, or a paragraph ending ``::``), their inline
    literals blanked: (line number, text)."""
    code_indent = None
    for number, line in enumerate(rst.splitlines(), 1):
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if code_indent is not None:
            if not stripped or indent > code_indent:
                continue
            code_indent = None
        if stripped.startswith(".. code-block::"):
            code_indent = indent
            continue
        if stripped.endswith("::") and not stripped.startswith(".."):
            code_indent = indent
        yield number, re.sub(r"``.*?``", " ", line)


def readme_figures(readme: str) -> list[tuple[int, str, list[str]]]:
    """Every figure in the README's prose: (line, figure as written, its number or the range's two)."""
    return [
        (line, m.group(0).strip(), re.findall(_NUMBER, m.group("number")))
        for line, text in _prose(readme)
        for m in _FIGURE.finditer(text)
    ]


def has_source(numbers: list[str], benchmarks: str) -> bool:
    """The same number (or the same range) appears in the benchmarks page, not as part of another."""
    figure = r"\s?(?:-|–|to)\s?".join(re.escape(n) for n in numbers)
    return re.search(rf"(?<![\d.,]){figure}(?!\d|[.,]\d)", benchmarks) is not None


def test_every_readme_figure_has_its_source_in_the_benchmarks():
    readme = (ROOT / "README.rst").read_text()
    benchmarks = (DOCS / "benchmarks.rst").read_text()
    figures = readme_figures(readme)
    assert figures, "no figure found in the README"
    unsourced = [
        f"README.rst:{line}: {figure}" for line, figure, numbers in figures if not has_source(numbers, benchmarks)
    ]
    assert unsourced == [], "figures whose number docs/benchmarks.rst does not have"


def readme_serve_commands() -> list[tuple[dict[str, str], list[str]]]:
    """Every ``skyinfer serve`` command line of the README's console blocks: its environment
    prefix (``CUDA_VISIBLE_DEVICES=...``) and its arguments after ``serve``."""
    commands = []
    for line in (ROOT / "README.rst").read_text().splitlines():
        words = line.split("#")[0].split()
        if words[:1] != ["$"] or "skyinfer" not in words:
            continue
        at = words.index("skyinfer")
        env = dict(w.split("=", 1) for w in words[1:at])
        if words[at + 1] == "serve":
            commands.append((env, words[at + 2 :]))
    return commands


def readme_config(argv: list[str], **overrides) -> ServeConfig:
    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    ns, engine_args = parser.parse_known_args(["serve", *argv])
    options = {field.name: getattr(ns, field.name) for field, _ in cli_fields()}
    return ServeConfig(**{"model": ns.model, "engine_args": tuple(engine_args), **options, **overrides})


def test_the_readme_8_gpu_layouts_split_the_node_as_they_say():
    """Each layout of the README, planned on an 8-GPU node as skyinfer plans it: the engines of
    the separate-devices layout take GPUs 2-3, 4-5 and 6-7 and leave the trainer's 0-1 alone; the
    colocated one spreads four engines of tp 2 over all eight, a trainer rank per GPU."""
    layouts = {}
    for env, argv in readme_serve_commands():
        config = readme_config(argv)
        gpus = parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES"), 8, lambda _uuid: False)
        groups = [p.env["CUDA_VISIBLE_DEVICES"] for p in split_gpus(gpus, config.workers_per_engine)]
        layouts[(env.get("CUDA_VISIBLE_DEVICES"), config.colocate)] = groups
    assert layouts[("2,3,4,5,6,7", False)] == ["2,3", "4,5", "6,7"]
    assert layouts[(None, True)] == ["0,1", "2,3", "4,5", "6,7"]
    readme = (ROOT / "README.rst").read_text()
    assert "CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2" in readme
    assert "torchrun --nproc-per-node 8" in readme


async def test_the_readme_separate_devices_layout_forms_its_group_as_it_says(
    aiohttp_client, demo_model, tmp_path, monkeypatch, group_init
):
    """The README's separate-devices layout run with its own flags over fake engines on a
    pretend 8-GPU node: three engines on GPUs 2-3, 4-5, 6-7, six workers (``/get_world_size``), an
    NCCL group of 1 + 6 ranks whose engines are told rank offsets 1, 3 and 5."""
    env, argv = next((e, a) for e, a in readme_serve_commands() if "CUDA_VISIBLE_DEVICES" in e)
    monkeypatch.setattr(devices, "_visible_gpus", lambda: parse_visible_devices(env["CUDA_VISIBLE_DEVICES"], 8, bool))
    config = readme_config(argv, model=str(demo_model), device="cuda", socket_dir=str(tmp_path))
    _, client = await serve_fakes(aiohttp_client, config)
    engines = (await (await client.get("/engines")).json())["engines"]
    assert [e["devices"]["ids"] for e in engines] == [["2", "3"], ["4", "5"], ["6", "7"]]
    assert (await (await client.get("/get_world_size")).json())["world_size"] == 6
    r = await client.post("/init_weight_transfer", json={"init_info": {**group_init, "world_size": 7}})
    assert r.status == 200, await r.text()
    assert (await r.json())["rank_offsets"] == [1, 3, 5]


# -- cross-process protocols (docs/protocols.rst) -------------------------------------------------

PROTOCOLS = DOCS / "protocols.rst"
# A double-backticked path of skyinfer's, and the double-backticked names right after it (only
# spaces, line breaks and commas between): what of that file the page says speaks a protocol.
_PATH_AND_NAMES = re.compile(r"``(skyinfer/[\w/]+\.py)``((?:[\s,]*``[A-Za-z_][\w.]*``)*)")
_LITERAL = re.compile(r"``(.+?)``", re.S)
# What marks a file of skyinfer's as one side of a protocol between processes.
_PROTOCOL_MARKERS = re.compile(
    r"SCM_RIGHTS|SIGUSR1|STACKS_SIGNAL|send_fds|recv_fds|pidfd_open|socketpair|os\.pipe|die_with_front"
    r"|lifeline_fd|report_fd|PR_SET_PDEATHSIG|sys\.stdin|X-Skyinfer-|CONTINUE_MARKER|call_utility_all_async"
)


def _definitions(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module's (or a class's) body defines: functions, classes, assigned names."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = node
    return names


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """The attributes a class's methods set on ``self``."""
    return {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and isinstance(node.ctx, ast.Store)
    }


def _resolves(path: str, dotted: str) -> bool:
    """Whether ``dotted`` (``name``, ``Class.method``, ``Class.attribute``) is defined in the file ``path``."""
    scope: ast.AST = ast.parse((ROOT / path).read_text())
    for part in dotted.split("."):
        if not isinstance(scope, (ast.Module, ast.ClassDef)):
            return False
        found = _definitions(scope.body).get(part)
        if found is None:
            return isinstance(scope, ast.ClassDef) and part == dotted.split(".")[-1] and part in _self_attributes(scope)
        scope = found
    return True


def protocol_page_names() -> list[tuple[str, str]]:
    """Every (file, name) the page gives as a side of a protocol, in the page's order."""
    named = []
    for match in _PATH_AND_NAMES.finditer(PROTOCOLS.read_text()):
        named.append((match.group(1), ""))
        named += [(match.group(1), name) for name in re.findall(r"``([^`]+)``", match.group(2))]
    return named


def _literal_words(page: str) -> set[str]:
    """Every word of the page's inline literals, a query string cut off (``/pause?mode=keep``: ``/pause``)."""
    return {
        word.split("?")[0].rstrip("(),:")
        for literal in _LITERAL.findall(page)
        for word in re.split(r"[\s(),]+", literal)
        if word
    }


def test_every_file_and_name_the_protocols_page_gives_exists():
    named = protocol_page_names()
    assert len({path for path, _ in named}) > 40 and len(named) > 200, "the page's names were not found"
    missing = sorted({path for path, _ in named if not (ROOT / path).is_file()})
    assert missing == [], "files named in docs/protocols.rst that do not exist"
    unresolved = [f"{path} {name}" for path, name in named if name and not _resolves(path, name)]
    assert unresolved == [], "names docs/protocols.rst gives that their file does not define"
    # The check catches a name misspelt (or moved to another file).
    assert _resolves("skyinfer/fleet/engine_templates.py", "EngineTemplates.fork")
    assert not _resolves("skyinfer/fleet/engine_templates.py", "EngineTemplates.frok")
    assert not _resolves("skyinfer/engine/template.py", "EngineTemplates.fork")


def test_every_side_of_a_protocol_is_on_the_protocols_page():
    """Every file of ``skyinfer/`` that passes descriptors, sends skyinfer's signals, makes its pipes
    and socket pairs, or names its headers is named on the page; so is every route an engine
    serves, every worker call of skyinfer's worker extension, every message of the front workers'
    lease channel and every ``X-Skyinfer-`` header."""
    page = PROTOCOLS.read_text()
    named = {path for path, _ in protocol_page_names()}
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "skyinfer").rglob("*.py"))}
    marked = sorted(path for path, text in sources.items() if _PROTOCOL_MARKERS.search(text))
    assert "skyinfer/engine/template.py" in marked and "skyinfer/engine/output.py" in marked
    assert [path for path in marked if path not in named] == []
    words = _literal_words(page)
    routes = {
        node.value
        for module in ("server", "admin", "weights", "adapters")
        for node in ast.walk(ast.parse(sources[f"skyinfer/engine/{module}.py"]))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"/[\w/]+", node.value)
    }
    assert "/swap_staged" in routes and "/conditions" in routes
    assert sorted(routes - words) == [], "engine routes the page does not give"
    extension = next(
        node
        for node in ast.parse(sources["skyinfer/engine/worker_extension.py"]).body
        if isinstance(node, ast.ClassDef) and node.name == "SkyinferWorkerExtension"
    )
    calls = {node.name for node in extension.body if isinstance(node, ast.FunctionDef)}
    assert sorted(calls - words) == [], "worker calls the page does not give"
    ops = set(re.findall(r'"op": "(\w+)"|op == "(\w+)"', sources["skyinfer/front_workers/leases.py"]))
    ops = {a or b for a, b in ops}
    assert {"lease", "release", "engines", "metrics"} <= ops
    assert sorted(op for op in ops if f'"op": "{op}"' not in page) == [], "lease messages the page does not give"
    headers = {h for text in sources.values() for h in re.findall(r'"(X-Skyinfer-[\w-]+)"', text)}
    assert sorted(headers - words) == [], "headers the page does not give"


def _vllm_patches(source: str) -> list[str]:
    """Where a module that takes vLLM's names (from ``vllm_api``) assigns to an attribute of vLLM's:
    of an object it imports from there, of a module it looks up (``importlib.import_module``,
    ``sys.modules``), an object's class, or an engine client's ``generate``."""
    tree = ast.parse(source)
    vllm_names = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("vllm_api")
        for alias in node.names
    }
    modules = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and (
            (isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "importlib.import_module")
            or (isinstance(node.value, ast.Subscript) and ast.unparse(node.value.value) == "sys.modules")
        )
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    if not vllm_names:
        return []
    return [
        ast.unparse(target)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute)
        and (
            target.attr in ("__class__", "generate")
            or (isinstance(target.value, ast.Name) and target.value.id in vllm_names | modules)
        )
    ]


def test_every_patch_of_vllm_is_in_the_patches_table():
    """Each module that replaces an attribute of vLLM's (the shapes ``_vllm_patches`` finds) is named
    in the page's section on vLLM's internals."""
    section = PROTOCOLS.read_text().split("vLLM internals skyinfer patches\n---", 1)[1]
    patching = {
        str(p.relative_to(ROOT)): found
        for p in sorted((ROOT / "skyinfer").rglob("*.py"))
        if (found := _vllm_patches(p.read_text()))
    }
    assert {"skyinfer/engine/cpu_setup.py", "skyinfer/engine/cpu_platform.py", "skyinfer/engine/cpu_worker.py"} <= set(
        patching
    )
    assert {path: found for path, found in patching.items() if f"``{path}``" not in section} == {}
