"""The order the suite runs in, and how long the session's servers live, so that no more servers
run at once than the machine's memory holds (2 cores, 24 GiB; an engine holds about 2.3 GiB).

Modules run in three stages, each in file order within it:

1. the modules that use the shared server's twins (behind front workers, behind keys): the twins
   start with the shared server and stop after the last test that uses them;
2. the modules that use the shared server itself: it stops after its last user;
3. the rest: modules with servers of their own (``module_servers`` in tests/support.py), each
   started while the module before it runs, and the modules over fake engines.

The modules that start no vLLM engine (``FRONT_ONLY``: the front over fake engines, or nothing)
spend most of their time waiting on the front's own timeouts, not computing: ``tools/run-tests``
runs them in a pytest of their own (``--lane front``), and ``support.ServerProcess`` refuses to
start a real server in that lane. The modules of real engines that mostly wait too (for a trainer
process, a restart, a probe: ``SECOND_ENGINES_LANE``) run in a second pytest of real engines
(``--lane engines-2``) beside the rest (``--lane engines-1``); ``--lane engines`` is both, in one
pytest. Each lane plans its own servers as above.
"""

from __future__ import annotations

import pytest

from support import FRONT_WORKERS, LAUNCHERS, PRESTARTED, ChildProcess, stop_all

__all__ = (
    "FRONT_ONLY",
    "LANES",
    "LAUNCHED",
    "PLAN",
    "SECOND_ENGINES_LANE",
    "in_lane",
    "lane_of",
    "servers_used",
    "session_server",
)

# The modules that start no vLLM engine; together about 3.5 minutes of the suite's wall time and a
# few CPU-seconds (tests/suite_report.py's --cpu-report).
FRONT_ONLY = frozenset(
    {
        "test_abandoned",
        "test_cross_origin",
        "test_docs",
        "test_fake_fleet",
        "test_front_workers",
        "test_layout",
        "test_plans",
        "test_python310",
        "test_raw_routing",
        "test_spare_supervision",
        "test_stream_relay",
        "test_transfer",
        "test_units",
    }
)


# The modules of real engines that run beside the busier rest: those whose wall time is mostly
# waiting (CPU-seconds per second of wall time 0.66-0.92 alone, tests/suite_report.py's
# --cpu-report: test_warm_restarts, test_weight_sync, test_faults, test_moe, test_quantized,
# test_catch_up), and others that make both engine lanes end about together (docs: benchmarks-journal).
SECOND_ENGINES_LANE = frozenset(
    {
        "test_catch_up",
        "test_faults",
        "test_ipc",
        "test_lora",
        "test_moe",
        "test_moe_colocated",
        "test_multinode",
        "test_quantized",
        "test_tensor_parallel",
        "test_warm_restarts",
        "test_weight_sync",
    }
)

# ``--lane``'s choices: each is one pytest of ``tools/run-tests``, but ``engines`` (both engine lanes in one).
LANES = ("front", "engines", "engines-1", "engines-2")


def lane_of(module: str) -> str:
    """The pytest of ``tools/run-tests`` a module runs in."""
    if module in FRONT_ONLY:
        return "front"
    return "engines-2" if module in SECOND_ENGINES_LANE else "engines-1"


def in_lane(module: str, lane: str | None) -> bool:
    """Whether a module runs in ``lane`` (``--lane``; None: every module)."""
    own = lane_of(module)
    return lane is None or lane == own or (lane == "engines" and own != "front")


# The session's servers, by fixture name; each registers its process here when it launches.
SHARED = "one_front_server"
TWINS = ("_workers_process", "_keyed_process", "_keyed_workers_process")
LAUNCHED: dict[str, ChildProcess] = {}


def session_server(name: str, srv: ChildProcess) -> ChildProcess:
    """A session server, launched: stopped after its last user (or at the session's end)."""
    LAUNCHED[name] = srv
    return srv


def servers_used(item: pytest.Item) -> set[str]:
    """The session's servers a test runs against: its fixtures, and for the modules that run both
    ways (``both_fronts``), the server of its way."""
    names = set(item.fixturenames)
    behind_workers = f"[{FRONT_WORKERS}" in item.name
    used = names & {SHARED, *TWINS}
    if "keyed_server" in names:
        used.add("_keyed_workers_process" if behind_workers else "_keyed_process")
    if "server" in names:
        used.add("_workers_process" if behind_workers else SHARED)
    return used


def _stage(module_items: list[pytest.Item]) -> int:
    used = set().union(*(servers_used(item) for item in module_items))
    if used & set(TWINS):
        return 1
    return 2 if SHARED in used else 3


class ServerPlan:
    def __init__(self):
        # After which test each session server stops (its last user's node id).
        self.last_user: dict[str, str] = {}
        # Each module, in the order the suite runs them; the one whose tests run now.
        self.modules: list[str] = []
        self.running_module: str | None = None
        # Where the session's demo model and temporary directories are (conftest's demo_model).
        self.demo_model = None
        self.tmp_path_factory = None

    def pytest_ignore_collect(self, collection_path, config: pytest.Config) -> bool | None:
        """Another lane's test module is not imported either: each lane's pytest imports its own
        (the whole suite cost each pytest 3-6 CPU-s more to collect)."""
        name = collection_path.name
        if name.startswith("test_") and name.endswith(".py") and not in_lane(name[:-3], config.getoption("--lane")):
            return True
        return None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        lane = config.getoption("--lane")
        here, elsewhere = [], []
        for item in items:
            (here if in_lane(item.module.__name__, lane) else elsewhere).append(item)
        if elsewhere:
            config.hook.pytest_deselected(items=elsewhere)
            items[:] = here
        modules: dict[str, list[pytest.Item]] = {}
        for item in items:
            modules.setdefault(item.nodeid.split("::")[0], []).append(item)
        ordered = sorted(modules.values(), key=_stage)  # stable: file order within a stage
        items[:] = [item for module in ordered for item in module]

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:
            for name in servers_used(item):
                self.last_user[name] = item.nodeid
            if item.module.__name__ not in self.modules:
                self.modules.append(item.module.__name__)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        yield
        module = item.module.__name__
        if module != self.running_module:
            self.running_module = module
            self._prestart_after(module)

    def _prestart_after(self, module: str) -> None:
        """Once a module's servers are up, the next module with servers of its own launches them,
        unless the twins still run (memory: the shared server, its twins and two more engines
        would not fit)."""
        if self.demo_model is None or any(name in LAUNCHED for name in TWINS):
            return
        later = self.modules[self.modules.index(module) + 1 :]
        upcoming = next((m for m in later if m in LAUNCHERS), None)
        if upcoming is not None and upcoming not in PRESTARTED:
            log_dir = self.tmp_path_factory.mktemp(upcoming)
            PRESTARTED[upcoming] = LAUNCHERS[upcoming](self.demo_model, log_dir)

    def pytest_sessionfinish(self) -> None:
        for launched in PRESTARTED.values():  # a module that never ran (deselected, or the run stopped)
            stop_all(launched)
        PRESTARTED.clear()

    @pytest.hookimpl(trylast=True)  # after the test's own fixtures: a module's may still use the server
    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        for name, last in self.last_user.items():
            if last == item.nodeid and name in LAUNCHED:
                LAUNCHED.pop(name).stop()


# Registered by conftest.py, whose session fixtures tell it what they launch.
PLAN = ServerPlan()
