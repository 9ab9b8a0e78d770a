import os
import resource
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_STARTED = time.monotonic()
# the slowest files (from the suite's --durations), handed out first so the two xdist workers finish
# together instead of one starting a long file when the other is nearly done; the rest keep their order
SLOW_FIRST = ("test_architectures.py", "test_checkpoint.py", "test_readme.py", "test_cli.py", "test_ep.py",
              "test_vlm.py")


def pytest_collection_modifyitems(session, config, items):
    order = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: each file stays whole


def _cpu_seconds() -> float:
    """CPU time of this process and of every child it has waited for (xdist workers, the rank
    server and its ranks, `fullshard` commands), user and system."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_sessionfinish(session, exitstatus):
    """Each pytest process (an xdist worker too) waits for its rank server before the totals."""
    from fullshard.testing.spawn import stop_fork_server

    stop_fork_server()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The suite's total: wall time since pytest started (the budget is 20 minutes on a 2-core
    machine) and CPU time, which says how much of it ran in parallel."""
    wall, cpu = time.monotonic() - _STARTED, _cpu_seconds()
    workers = getattr(config.option, "numprocesses", None)
    terminalreporter.write_sep("=", f"suite total: {wall:.0f} s wall ({wall / 60:.1f} min), {cpu:.0f} s CPU "
                                    f"({cpu / max(wall, 1e-9):.0%} of one core), xdist workers: {workers or 0}")
