"""BenchFolder: the layout of a sweep's folder (`dptrain bench sweep --output.dir`, or a `dptrain bench tune` folder),
every file and folder of it named once, as RunFolder names a run's. The lab's modules take their names from here;
every file the lab writes here is written atomically (dptrain.files.written_atomically), but a point's bench.log, which is the
output of its command as it runs.

    BENCH/
      sweep.json          the sweep's shared config and warm-up, so that a resumed sweep runs the same points
      peak.json           the matmul probe (peak.py): the denominator of fraction_of_peak
      link.json           the link probe (link.py): the scaling model's alpha and bandwidth
      link-probe/nodes-N/ the job script and output of the link probe between N nodes (--slurm)
      results.csv         one row per point and repeat (collect.py)
      summary.csv         the repeats of a point averaged, with speedup and efficiency
      report.md, *.png    `dptrain report BENCH`: epoch_time, speedup, validation, memory, scaling_model
      tuned.toml, tune.csv, tune.md   `dptrain bench tune`: the configuration chosen, what was tried, why
      runs/<point>/       each point's run folder (a RunFolder), with the lab's own files:
        bench.log, bench_error.txt, job_id.txt, trial.toml
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dptrain.reporting.sweep_files import PEAK_FILE

SWEEPS_DIR = Path("runs") / "bench"  # a sweep's folder is SWEEPS_DIR/<data.name> unless --output.dir names one
TUNES_DIR = Path("runs") / "tune"  # a tune folder is TUNES_DIR/<data.name> unless --output.dir names one

SWEEP_FILE = "sweep.json"
LINK_FILE = "link.json"
LINK_PROBE_DIR = "link-probe"
RESULTS_FILE = "results.csv"
SUMMARY_FILE = "summary.csv"
REPORT_FILE = "report.md"
TUNED_FILE = "tuned.toml"
TUNE_TABLE_FILE = "tune.csv"
TUNE_NOTES_FILE = "tune.md"
RUNS_DIR = "runs"
LINK_PROBE_NODES = "nodes-{nodes}"  # in LINK_PROBE_DIR: the link probe's job between that many nodes
# The report's plots (report.py gives each its title)
EPOCH_TIME_PLOT = "epoch_time.png"
SPEEDUP_PLOT = "speedup.png"
VALIDATION_PLOT = "validation.png"
MEMORY_PLOT = "memory.png"
SCALING_PLOT = "scaling_model.png"
# In a point's run folder, beside what the run itself writes there:
LOG_FILE = "bench.log"  # the point's command's output
ERROR_FILE = "bench_error.txt"  # why its command failed (none: it ran through)
JOB_ID_FILE = "job_id.txt"  # the id of the job submitted for it, so that a resumed sweep can ask about it
TRIAL_CONFIG_FILE = "trial.toml"  # a `bench tune` trial run's configuration


@dataclass(frozen=True)
class BenchFolder:
    """The paths of one sweep's folder; nothing is read or made here."""

    root: Path

    @property
    def sweep(self) -> Path:
        return self.root / SWEEP_FILE

    @property
    def peak(self) -> Path:
        return self.root / PEAK_FILE

    @property
    def link(self) -> Path:
        return self.root / LINK_FILE

    @property
    def results(self) -> Path:
        return self.root / RESULTS_FILE

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY_FILE

    @property
    def report(self) -> Path:
        return self.root / REPORT_FILE

    @property
    def runs(self) -> Path:
        return self.root / RUNS_DIR

    @property
    def tuned(self) -> Path:
        return self.root / TUNED_FILE

    @property
    def tune_table(self) -> Path:
        return self.root / TUNE_TABLE_FILE

    @property
    def tune_notes(self) -> Path:
        return self.root / TUNE_NOTES_FILE

    def point(self, name: str) -> Path:
        """A point's run folder."""
        return self.runs / name

    def link_probe(self, nodes: int) -> Path:
        """The folder of the link probe's job between `nodes` nodes."""
        return self.root / LINK_PROBE_DIR / LINK_PROBE_NODES.format(nodes=nodes)
