import os
import resource
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_STARTED = time.monotonic()
# the slowest files (from the suite's --durations), handed out first so the two xdist workers finish
# together instead of one starting a long file when the other is nearly done; the rest keep their order
SLOW_FIRST = ("test_cli.py", "test_vlm.py", "test_rundir.py", "test_architectures.py", "test_generate.py",
              "test_checkpoint.py", "test_ep.py", "test_tp.py", "test_pp.py", "test_float8.py")


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


def _file_loads(terminalreporter) -> tuple[dict, dict]:
    """Per test file: (worker, seconds of setup + call + teardown, last stop); per worker: (seconds
    busy, last stop). Stops are epoch seconds (a report's `stop`, which xdist carries over)."""
    files, workers = {}, {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) not in ("setup", "call", "teardown"):
                continue
            node = getattr(report, "node", None)
            worker = getattr(getattr(node, "gateway", None), "id", "main")
            path = report.nodeid.split("::")[0]
            _, seconds, stop = files.get(path, (worker, 0.0, 0.0))
            files[path] = (worker, seconds + report.duration, max(stop, getattr(report, "stop", 0.0)))
            busy, last = workers.get(worker, (0.0, 0.0))
            workers[worker] = (busy + report.duration, max(last, getattr(report, "stop", 0.0)))
    return files, workers


def _write_loads(terminalreporter, started: float) -> None:
    """The slowest files and how the xdist workers shared the load: a worker that finishes long
    before the other is a file order to change (SLOW_FIRST) or a file to split."""
    files, workers = _file_loads(terminalreporter)
    if not files:
        return
    terminalreporter.write_sep("=", "slowest files (seconds of setup + call + teardown)")
    for path, (worker, seconds, stop) in sorted(files.items(), key=lambda kv: -kv[1][1])[:30]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}  ({worker}, done at {stop - started:.0f} s)")
    for worker, (busy, last) in sorted(workers.items()):
        terminalreporter.write_line(f"worker {worker}: {busy:.0f} s of tests, its last done at {last - started:.0f} s")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The suite's total: wall time since pytest started (the budget is 20 minutes on a 2-core
    machine) and CPU time, which says how much of it ran in parallel; before it, the slowest files
    and each worker's load."""
    wall, cpu = time.monotonic() - _STARTED, _cpu_seconds()
    _write_loads(terminalreporter, time.time() - wall)
    workers = getattr(config.option, "numprocesses", None)
    terminalreporter.write_sep("=", f"suite total: {wall:.0f} s wall ({wall / 60:.1f} min), {cpu:.0f} s CPU "
                                    f"({cpu / max(wall, 1e-9):.0%} of one core), xdist workers: {workers or 0}")
