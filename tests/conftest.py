"""Shared helpers: run the real `dptrain` CLI in a subprocess under a hard timeout, or planned runs batched on ranks."""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest

from tests.ranks import free_port, run_cli_on_ranks

REPO = Path(__file__).resolve().parents[1]


# Tests that need root (a tmpfs mounted full or read-only, a file given to another user, the private clusters) skip
# themselves without it, saying so in their reason. Counted apart, they show in the summary line ("4 skipped without
# root") and in a section listing why, so that a run without root never looks as if it had run them.
NEEDS_ROOT = re.compile(r"\bneeds? root\b")
SKIPPED_WITHOUT_ROOT = "skipped without root"


def skip_reason(report: pytest.TestReport) -> str | None:
    """Why the test was skipped, as pytest.skip or a skipif mark gave it; None if it was not."""
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return None
    return report.longrepr[2].removeprefix("Skipped: ")


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config) -> tuple[str, str, tuple] | None:
    reason = skip_reason(report)
    if reason is not None and NEEDS_ROOT.search(reason):
        return SKIPPED_WITHOUT_ROOT, "s", ("SKIPPED (needs root)", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    skipped = terminalreporter.stats.get(SKIPPED_WITHOUT_ROOT, [])
    if not skipped:
        return
    terminalreporter.section(f"{len(skipped)} skipped without root: run the suite as root to run them", sep="-",
                             yellow=True)
    for reason, count in collections.Counter(skip_reason(report) for report in skipped).most_common():
        terminalreporter.write_line(f"{count} x {reason}")


# The session's fixtures that start real clusters, hosts or rank processes: a test that uses one is slow.
STARTS_PROCESSES = {"slurm_cluster", "slurm_link_probes", "machine_probes", "planned_run", "two_hosts"}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A nightly test is a slow one too: `-m "not slow"` (the quick loop) replaces the default `-m "not gpu and not
    nightly"`, and must still leave it out; so is a test that uses a fixture of STARTS_PROCESSES."""
    for item in items:
        starts = STARTS_PROCESSES.intersection(getattr(item, "fixturenames", ()))
        if (item.get_closest_marker("nightly") is not None or starts) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _log_handlers_as_found():
    """A test that runs dptrain in this process (setup_logging) leaves handlers writing to that test's captured
    streams, which pytest then closes: a later test's log line printed '--- Logging error ---' into the stderr it
    checks (the SLURM sweep's failed-job test, after tests/strategies/test_deepspeed.py). So each test removes the
    handlers it added to the root and dptrain loggers; pytest's own (log capture) it removes itself."""
    loggers = [logging.getLogger(), logging.getLogger("dptrain")]
    found = [set(logger.handlers) for logger in loggers]
    yield
    for logger, kept in zip(loggers, found):
        for handler in [h for h in logger.handlers if h not in kept and not type(h).__module__.startswith("_pytest")]:
            logger.removeHandler(handler)
            handler.close()


@pytest.fixture(scope="session")
def machine_probes(tmp_path_factory) -> Path:
    """A folder holding this machine's matmul probe (1 and 2 workers, float32) and link probe (2 processes), made
    once a session: the sweeps of tests that are not about the probes take them with `--probes-from` (the probes
    cost about 10 s a sweep)."""
    from dptrain_bench import link, peak

    folder = tmp_path_factory.mktemp("probes")
    peak.record(folder, "cpu", "float32", (1, 2))
    link.record(folder, "cpu", (2,))
    return folder


@pytest.fixture(scope="session")
def slurm_link_probes(slurm_cluster, tmp_path_factory) -> Path:
    """A folder whose link.json holds a real probe of the link between the test cluster's 2 nodes (one task each,
    `srun ... -m dptrain_bench.link --launched`), made once a session: the SLURM sweeps of tests that are not about
    the probe take it with `--probes-from` instead of running a probe job each (about 5 s a sweep here)."""
    from dptrain_bench import link

    folder = tmp_path_factory.mktemp("slurm-link")
    # the test cluster's nodes are this machine: its loopback joins them
    done = slurm_cluster.run("srun", "-N", "2", "--ntasks-per-node", "1",
                             f"--export=ALL,MASTER_ADDR=127.0.0.1,MASTER_PORT={free_port()}", sys.executable, "-m",
                             "dptrain_bench.link", "--launched", "--record", str(folder), timeout=120, cwd=REPO)
    record = link.read_link(folder)
    assert done.returncode == 0 and record is not None and (2, 2) in record.probes, done.stderr[-2000:]
    return folder


# SLURM's client commands. A test that is not about SLURM but runs `dptrain submit` (a dry run, say) runs without them
# (no_slurm_clients): on a machine where SLURM is installed but no controller answers, each sinfo that submit asks
# waited out its 5 s timeout (29 calls, 138 s of a suite run on one machine); the partition check is then skipped, as
# on a login node without SLURM's clients. The tests about the check run it on the private cluster, and
# tests/slurm/test_submit.py keeps a sinfo that does not answer in time.
SLURM_CLIENTS = ("sinfo", "sbatch", "srun", "squeue", "scontrol", "sacct", "scancel", "salloc", "sattach", "sstat",
                 "sprio", "sshare", "sdiag", "strigger", "sreport", "sacctmgr", "sbcast", "scrontab")


@pytest.fixture(scope="session")
def path_without_slurm(tmp_path_factory) -> str:
    """A folder of links to every command on this PATH but SLURM's clients, as a PATH of one folder."""
    folder = tmp_path_factory.mktemp("path-without-slurm")
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for entry in os.scandir(directory):
            link = folder / entry.name
            if entry.name not in SLURM_CLIENTS and not os.path.lexists(link):  # the first on PATH wins, as a lookup
                link.symlink_to(entry.path)
    return str(folder)


@pytest.fixture
def no_slurm_clients(request, monkeypatch, path_without_slurm) -> None:
    """This test (and what it starts) runs without SLURM's clients on PATH, unless it uses the private cluster."""
    if "slurm_cluster" not in request.fixturenames:
        monkeypatch.setenv("PATH", path_without_slurm)


REGOLD = "DPTRAIN_REGOLD"


def assert_matches_golden(text: str, golden: Path) -> None:
    """`text` is the golden file's. Under DPTRAIN_REGOLD=1 the file is rewritten with it instead, and the test fails
    saying so: compared with the file just written, it would pass whatever the text."""
    if os.environ.get(REGOLD) == "1":
        golden.write_text(text)
        pytest.fail(f"{REGOLD}=1 rewrote {golden}, so nothing was compared; read its diff (git diff -- {golden}), then "
                    f"run the test again without {REGOLD}.", pytrace=False)
    assert text == golden.read_text()


def run_cli(args: list[str], cwd: Path, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m dptrain ARGS` with tests/ importable (user models), killed after `timeout` seconds."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "dptrain", *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def start_cli(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m dptrain ARGS` started in the background (the caller waits, with a timeout)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "dptrain", *args], cwd=cwd, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def two_ranks_apart(args: list[str], cwd: Path, env: dict[str, str], local_world_size: int = 1
                    ) -> tuple[list[subprocess.Popen], str]:
    """`dptrain ARGS` as ranks 0 and 1 started apart, as on two nodes with no agent over them, both with env; waits
    for both (rank 0 two minutes, rank 1 then 30 s; both killed whatever happened) and returns them with rank 0's
    stderr."""
    port = free_port()
    ranks = [start_cli(args, cwd, {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                   "LOCAL_WORLD_SIZE": str(local_world_size), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), **env}) for rank in (0, 1)]
    try:
        _, err0 = ranks[0].communicate(timeout=120)
        ranks[1].communicate(timeout=30)
    finally:
        for proc in ranks:
            proc.kill()
    return ranks, err0


def log_tail(run_dir: Path) -> str:
    """The end of rank 0's log of a run, for a failure message."""
    log = run_dir / "logs" / "rank0.log"
    return log.read_text()[-3000:] if log.is_file() else "(no log: refused before start)"


def read_events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def assert_trained_alike(run_dir: Path, reference: Path, steps: int, relative: float = 1e-12) -> dict:
    """The float64 runs trained alike: each step's loss (as last computed: a resumed run logs the steps past its
    snapshot twice) and the final weights within `relative` of the reference's, over `steps` steps; its weights."""
    import torch

    losses = {e["step"]: e["loss"] for e in read_events(run_dir, "step")}
    expected = {e["step"]: e["loss"] for e in read_events(reference, "step")}
    assert sorted(losses) == sorted(expected) == list(range(1, steps + 1)), (losses, expected)
    assert all(abs(losses[k] - expected[k]) <= relative * abs(expected[k]) for k in expected), (losses, expected)
    ours, theirs = torch.load(run_dir / "model.pt"), torch.load(reference / "model.pt")
    for name, ref in theirs.items():
        assert ours[name].dtype == torch.float64, name
        assert (ours[name] - ref).abs().max() <= relative * ref.abs().max(), name
    return theirs


@pytest.fixture
def cli(tmp_path: Path):
    def call(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return run_cli(list(args), tmp_path, timeout, env)

    return call


# CLI runs shared across test modules. A module declares its multi-rank runs at import (plan_runs), so
# that by the first test every collected module's runs are known; the first test that needs one run of a
# world size and precision then makes all of them at once, on the rank processes of that precision's pool
# (run_cli_on_ranks, side by side: they are independent), started once for the session: a run there costs only
# its own work. (A collected module's runs are made even if -k deselects their tests: a few seconds each.)
FLOAT64_ENV = {"PYTHONPATH": f"{Path(__file__).parent / 'float64'}{os.pathsep}{REPO}"}  # every rank computes in float64
Precision = Literal["fp32", "float64"]
PLANNED: dict[str, tuple[tuple[str, ...], tuple[int, ...], Precision, tuple[int, ...]]] = {}


def plan_runs(runs: dict[str, tuple[list[str], tuple[int, ...]]], precision: Precision = "fp32",
              nightly_worlds: tuple[int, ...] = ()) -> None:
    """Declare `dptrain ARGV` runs by name (unique over the test suite): ARGV without --output.dir, its world sizes.
    nightly_worlds: those of its world sizes that only nightly tests read (made only in a session that selects one)."""
    for name, (argv, worlds) in runs.items():
        planned = (tuple(argv), tuple(worlds), precision, tuple(nightly_worlds))
        assert PLANNED.setdefault(name, planned) == planned, f"two different runs are both named {name}"


@pytest.fixture(scope="session")
def planned_run(tmp_path_factory, request):
    """planned_run(name, world) -> the run folder of that run of PLANNED, finished with exit code 0."""
    made: dict[tuple[str, int], tuple[Path, int]] = {}  # (run folder, rank 0's exit code)
    broken: dict[tuple[str, int], str] = {}  # (precision, world) -> why that set of ranks failed as a whole
    nightly = any(item.get_closest_marker("nightly") for item in request.session.items)  # selected ones only

    def get(name: str, world: int) -> Path:
        precision = PLANNED[name][2]
        if (precision, world) in broken:  # fail at once, not after running the whole batch again
            pytest.fail(broken[(precision, world)])
        if (name, world) not in made:
            names = [n for n, (_, worlds, p, later) in PLANNED.items()
                     if world in worlds and p == precision and (n, world) not in made
                     and (n == name or nightly or world not in later)]
            root = tmp_path_factory.mktemp(f"{precision}-world{world}")
            dirs = [root / n.replace("/", "-") for n in names]
            argvs = [[*PLANNED[n][0], "--output.dir", str(d)] for n, d in zip(names, dirs)]
            try:  # a minute a run at most: a hang fails the batch, not the suite
                codes = run_cli_on_ranks(world, argvs, str(root), timeout=min(900, 60 * len(argvs)),
                                         env=FLOAT64_ENV if precision == "float64" else None, side_by_side=True)
            except (AssertionError, queue.Empty) as exc:  # a rank raised, or a rank went silent
                broken[(precision, world)] = f"the {precision} runs on {world} ranks failed: {exc!r}"[:3000]
                raise
            made.update({(n, world): (d, code) for n, d, code in zip(names, dirs, codes)})
        run_dir, code = made[(name, world)]
        assert code == 0, f"run {name} on {world} ranks failed: " + log_tail(run_dir)
        return run_dir

    return get


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """One private SLURM cluster (tests/slurm_cluster.py) for the whole session; skipped, with the reason, where
    this machine cannot run one."""
    from tests.slurm_cluster import SlurmCluster

    reason = SlurmCluster.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with SlurmCluster.start(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
