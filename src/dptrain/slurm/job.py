"""The job of a run: Job (its run folder, the folder it runs in, its shape, its name and log files), made by
job_for from a config, which checks what the script's lines must carry; and the Python the job runs.

The rest of a job has a module each: script.py writes its sbatch script (render) and sbatch_lines.py its #SBATCH
lines; containers.py starts its ranks in a container; partition.py checks that a partition can hold it; queue.py
submits it and waits; requeue.py puts it back in the queue after a stop.
"""

from __future__ import annotations

import getpass
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from dptrain.config import RunConfig, SlurmConfig
from dptrain.errors import ConfigError
from dptrain.run_folder import RunFolder
from dptrain.slurm.containers import check_container

SCRIPT_NAME = RunFolder(Path(".")).job_script.name
CONFIG_NAME = RunFolder(Path(".")).job_config.name
# What sbatch fills in a file name (--output, --error) that dptrain knows at submission: %j, %A (the job id; a job
# that is no array is its own), %x (its name), %u (the user), %% (a %); a width pads a number (%8j). The others (%N,
# the node; %t, the task) are left as written.
FILE_PATTERN = re.compile(r"%(%|(\d*)([jAxu]))")
UNSAFE_IN_PATHS = "\"'$`\\"  # quotes, a shell's $ and `, a backslash: neither an #SBATCH line nor a shell line carries them


@dataclass(frozen=True)
class Job:
    """One run's job: its script's path, its config's path, the folder it runs in, the shape of its world, its name
    in squeue and the files SLURM writes its output and errors to."""

    run_dir: Path
    workdir: Path
    nodes: int
    ranks_per_node: int
    mode: str
    name: str
    output_file: Path | None = None
    """sbatch --output as given (absolute; sbatch's %j and friends in it); None: logs/slurm-%j.out of the run."""
    error_file: Path | None = None
    """sbatch --error as given; None: the output file where one is given (as sbatch does), else the run's .err."""

    @property
    def script(self) -> Path:
        return self.run_dir / SCRIPT_NAME

    @property
    def config(self) -> Path:
        return self.run_dir / CONFIG_NAME

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def shape(self) -> str:
        """'2 nodes x 4 ranks', as the script's first line, `dptrain submit` and the sweep's log say it."""
        return f"{counted(self.nodes, 'node')} x {counted(self.ranks_per_node, 'rank')}"

    @property
    def named_after_its_run(self) -> bool:
        return self.name == job_name(self.run_dir.name)

    def output(self, job_id: str = "%j") -> Path:
        """The job's output file: as the #SBATCH line names it (job_id %j), or job job_id's."""
        return self._file(self.output_file, job_id, "out")

    def errors(self, job_id: str = "%j") -> Path:
        """The job's error file, as output()."""
        return self._file(self.error_file or self.output_file, job_id, "err")

    def _file(self, given: Path | None, job_id: str, stream: str) -> Path:
        if given is None:
            return RunFolder(self.run_dir).job_output(job_id, stream)
        return given if job_id == "%j" else Path(filled(str(given), job_id, self.name))


def filled(pattern: str, job_id: str, name: str) -> str:
    """A file name as sbatch writes it for job job_id named name (FILE_PATTERN)."""
    def one(match: re.Match[str]) -> str:
        if match.group(1) == "%":
            return "%"
        width, letter = match.group(2), match.group(3)
        value = {"j": job_id, "A": job_id, "x": name, "u": getpass.getuser()}[letter]
        return value.zfill(int(width)) if width and letter in "jA" else value

    return FILE_PATTERN.sub(one, pattern)


def job_for(cfg: RunConfig, workdir: Path, name: str | None = None, output: str | None = None,
            error: str | None = None) -> Job:
    """The job of cfg's run, with its run folder made absolute against workdir (where the job will run); its name
    (default: the run's, job_name) and the files of its output and errors (sbatch's --output and --error; default:
    the run's logs/slurm-%j.out and .err) as given to `dptrain submit`. ConfigError in one sentence for what the
    script's lines cannot carry, and for a container that cannot start."""
    run_dir = cfg.output.run_dir if cfg.output.run_dir.is_absolute() else workdir / cfg.output.run_dir
    for what, path in (("the run folder", run_dir), ("the folder dptrain submit runs in", workdir)):
        if any(c.isspace() or c in UNSAFE_IN_PATHS + "%" for c in str(path)):
            raise ConfigError(f"{what} {str(path)!r} holds a space, quote or other character that #SBATCH lines cannot "
                              f"carry; choose a plain path (--output.dir, or submit from another folder).")
    files = {option: log_file(option, value, workdir) for option, value in (("--output", output), ("--error", error))}
    job = Job(run_dir, workdir, cfg.slurm.nodes, cfg.slurm.ranks_here, cfg.slurm.mode, name or job_name(run_dir.name),
              files["--output"], files["--error"])
    check_container(cfg.slurm, run_dir, workdir)
    return job


def log_file(option: str, given: str | None, workdir: Path) -> Path | None:
    """The file of sbatch's --output or --error as given, absolute against workdir (the job's --chdir, against which
    sbatch reads it too); ConfigError in one sentence for a folder or a character the lines cannot carry."""
    if given is None:
        return None
    path = Path(given).expanduser()
    path = path if path.is_absolute() else workdir / path
    if any(c.isspace() or not c.isprintable() or c in UNSAFE_IN_PATHS for c in str(path)):
        raise ConfigError(f"{option} {given!r} holds a space, quote or other character that the job's #SBATCH line "
                          f"cannot carry; give a plain path.")
    if path.is_dir() or given.endswith("/"):
        raise ConfigError(f"{option} {given!r} names a folder; give the file SLURM writes to, e.g. "
                          f"{Path(given) / 'slurm-%j.log'}.")
    return path


def job_name(run_name: str) -> str:
    """The job's name in squeue: the run's, marked as dptrain's (bench points' names say so already)."""
    return run_name if run_name.startswith("dptrain") else f"dptrain-{run_name}"


def counted(number: int, word: str) -> str:
    return f"{number} {word}{'' if number == 1 else 's'}"


def shown(path: Path, workdir: Path) -> str:
    """path relative to workdir where it lies inside it (as the user named the run), else as it is."""
    try:
        return str(path.relative_to(workdir))
    except ValueError:
        return str(path)


def python_for(s: SlurmConfig) -> str:
    """The interpreter the job runs: as configured; python when set-up lines or a container provide one (this one is
    not inside a container); else this one."""
    if s.python:
        return s.python
    return "python" if s.setup or s.container else sys.executable
