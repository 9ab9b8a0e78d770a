import os
import resource
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_STARTED = time.monotonic()


def _cpu_seconds() -> float:
    """CPU time of this process and of every child it has waited for (xdist workers, spawned ranks,
    `fullshard` commands), user and system."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The suite's total: wall time since pytest started (the budget is 20 minutes on a 2-core
    machine) and CPU time, which says how much of it ran in parallel."""
    wall, cpu = time.monotonic() - _STARTED, _cpu_seconds()
    workers = getattr(config.option, "numprocesses", None)
    terminalreporter.write_sep("=", f"suite total: {wall:.0f} s wall ({wall / 60:.1f} min), {cpu:.0f} s CPU "
                                    f"({cpu / max(wall, 1e-9):.0%} of one core), xdist workers: {workers or 0}")
