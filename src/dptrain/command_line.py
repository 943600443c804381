"""What the commands' command lines share: the --section.option VALUE pairs, the job's options (one per field of
SlurmConfig) that `dptrain submit` and the lab's `dptrain bench sweep --slurm` take, and sbatch's own options under their
own names (SBATCH_NAMES: `dptrain submit --ntasks-per-node 4 --gres gpu:4 -w dgx01`). Below the commands, so that the
measuring lab builds its command lines from here without importing `dptrain.cli` (which imports the launchers).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

from dptrain import config as config_mod, spellings
from dptrain.config import SlurmConfig
from dptrain.config.slurm import SBATCH, SbatchOf
from dptrain.errors import ConfigError
from dptrain.slurm.sbatch_lines import JOB_LINES, ONE_WORD, SbatchOption, check_sbatch_option


def split_overrides(extra: list[str]) -> list[tuple[str, str]]:
    """['--optim.lr', '3e-4', '--train.bf16=true'] -> [('optim.lr', '3e-4'), ('train.bf16', 'true')]."""
    pairs, i = [], 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.option value.")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(extra) or extra[i + 1].startswith("--"):
                raise ConfigError(f"option --{key} needs a value, for example --{key} VALUE.")
            value, i = extra[i + 1], i + 1
        pairs.append((key, value))
        i += 1
    spellings.check_known(pairs)
    return pairs


JobOptionKind = Literal["value", "flag", "lines"]


def job_options(kind: JobOptionKind) -> list[str]:
    """The job options of one kind (add_job_options), in the order of SlurmConfig's fields: valued ones, flags (a
    bool field), repeatable lines (a list field)."""
    hints = typing.get_type_hints(SlurmConfig)
    return [f.name for f in dataclasses.fields(SlurmConfig) if job_option_kind(hints[f.name]) == kind]


def job_option_kind(tp: Any) -> JobOptionKind:
    if tp is bool:
        return "flag"
    return "lines" if typing.get_origin(tp) is tuple else "value"


def submit_overrides(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The job options (add_job_options) as slurm.* overrides (they win over the file's [slurm] table)."""
    pairs = [(f"slurm.{name}", str(getattr(args, name))) for name in job_options("value") if getattr(args, name) is not None]
    pairs += [(f"slurm.{flag}", "true") for flag in job_options("flag") if getattr(args, flag)]
    return pairs


def job_lines(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """The repeatable job options given (--setup, --sbatch): they replace the file's lists of the same name."""
    return {name: tuple(getattr(args, name)) for name in job_options("lines") if getattr(args, name)}


def job_options_given(args: argparse.Namespace) -> list[str]:
    """The job options given on the command line, as they were spelled (--nodes, --setup, ...)."""
    given = [name for name in job_options("value") if getattr(args, name) is not None]
    given += [name for name in (*job_options("flag"), *job_options("lines")) if getattr(args, name)]
    return ["--" + name.replace("_", "-") for name in given]


# What one item of a repeatable job option is, as --help names it: a LINE of the script unless said here.
JOB_ITEM_METAVARS = {"sbatch": "OPTION"}


def add_job_options(command: argparse.ArgumentParser, title: str, meaning: dict[str, str] | None = None,
                    as_text: tuple[str, ...] = ()) -> None:
    """The job's options, shared by submit and bench sweep --slurm: one per field of SlurmConfig (--gpus-per-node sets
    slurm.gpus_per_node), its docstring as help unless `meaning` gives the command's own; submit_overrides and job_lines
    read them. Each defaults to None (or no flag, no line): the --config file's [slurm] table then decides. The
    fields in as_text are taken as text, which the command reads itself (bench's --nodes 1,2,4)."""
    job = command.add_argument_group(title)
    docs = config_mod.field_docs(SlurmConfig)
    hints = typing.get_type_hints(SlurmConfig)
    for f in dataclasses.fields(SlurmConfig):
        tp = hints[f.name]
        kind = job_option_kind(tp)
        text = " ".join((meaning or {}).get(f.name, docs.get(f.name, "")).split()).replace("%", "%%")  # % is argparse's
        option = "--" + f.name.replace("_", "-")
        if kind == "flag":
            job.add_argument(option, action="store_true", help=text)
        elif kind == "lines":
            job.add_argument(option, action="append", default=[], metavar=JOB_ITEM_METAVARS.get(f.name, "LINE"),
                             help=f"{text} (repeatable)")
        else:  # None where not given: the file's value, else the field's default (shown where there is one)
            shown = "" if f.default is None else f" (default: {f.default})"
            choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else None
            typed = int if tp is int and f.name not in as_text else None
            job.add_argument(option, type=typed, choices=choices, help=text + shown)


@dataclass(frozen=True)
class SbatchName:
    """One of sbatch's options, as `dptrain submit` takes it under sbatch's name: what it becomes in the job. Where the
    job writes that option itself, its name is the writer's (the slurm.<field>'s SbatchOf, or the job's own line of
    slurm/sbatch_lines.py's JOB_LINES): only the options written as given are named here."""

    becomes: str
    """slurm.<field>: the job option of the same meaning; JOB_OWN: the job's own line (its name, its files, which
    slurm.job.job_for takes); AS_GIVEN: an #SBATCH line written as given (slurm.sbatch), as dptrain has no option
    of its meaning."""
    help: str
    metavar: str
    option: str | None = None
    """sbatch's name (--gres): the job's own line's, looked up in JOB_LINES, or one written as given; None for a
    slurm.<field>, whose metadata names it."""
    typed: type | None = None
    per_task: bool = False
    """The value is per srun task, the field's per node: it is set to the value times the tasks per node."""

    @property
    def written(self) -> SbatchOf | None:
        """The option as the job's writer has it, where the job writes it itself."""
        if self.becomes.startswith("slurm."):
            field = next(f for f in dataclasses.fields(SlurmConfig) if f.name == self.becomes.removeprefix("slurm."))
            return field.metadata[SBATCH]
        if self.becomes == JOB_OWN:
            return next(line.of for line in JOB_LINES if line.of.option == self.option)
        return None

    @property
    def name(self) -> str:
        """sbatch's name without its dashes: ntasks-per-node."""
        of = self.written
        return (of.option if of is not None else self.option or "").removeprefix("--")

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def flags(self) -> tuple[str, ...]:
        short = SHORT_FLAGS.get(self.name)
        return ("--" + self.name, *((short,) if short else ()))


JOB_OWN, AS_GIVEN = "job", "as given"
SHORT_FLAGS = {"nodelist": "-w"}  # the one-letter forms submit takes (the tutorials' `-w dgx01`)
# sbatch's options under their own names, as the tutorials' job scripts write them (#SBATCH --ntasks-per-node=4).
# --nodes and --gpus-per-node are job options already (sbatch's names); the job options' other names are dptrain's.
SBATCH_NAMES = (
    SbatchName("slurm.ranks_per_node", "sbatch's name of --ranks-per-node: one srun task per rank", "N", typed=int),
    SbatchName("slurm.cpus_per_node", "cores per srun task (per rank; in agent mode, per node): sets --cpus-per-node "
               "to C times the tasks per node", "C", typed=int, per_task=True),
    SbatchName(AS_GIVEN, "GPUs of the whole job (N, or TYPE:N), shared evenly over its nodes", "N", "--gpus"),
    SbatchName(AS_GIVEN, "generic resources per node; gpu:4 or gpu:a100:4 asks for GPUs", "GRES", "--gres"),
    SbatchName(JOB_OWN, "the job's name in squeue (default: dptrain-RUN, after the run folder)", "NAME", "--job-name"),
    SbatchName(JOB_OWN, "the file of the job's output, as sbatch names it (%j: the job id, %x: its name; relative to "
               "the folder dptrain submit runs in; default: RUN_DIR/logs/slurm-%j.out)", "FILE", "--output"),
    SbatchName(JOB_OWN, "the file of the job's errors (default: the --output file where one is given, as sbatch does, "
               "else RUN_DIR/logs/slurm-%j.err)", "FILE", "--error"),
    SbatchName(AS_GIVEN, "the nodes the job must run on: dgx01,dgx02 or dgx[01-02]", "NODES", "--nodelist"),
    SbatchName(AS_GIVEN, "nodes the job must not run on", "NODES", "--exclude"),
    SbatchName(AS_GIVEN, "when SLURM mails the user: BEGIN, END, FAIL, ALL, ...", "TYPE", "--mail-type"),
    SbatchName(AS_GIVEN, "who SLURM mails (default: the user who submits)", "USER", "--mail-user"),
)


def add_sbatch_names(command: argparse.ArgumentParser) -> None:
    """sbatch's own options under their own names (SBATCH_NAMES), for `dptrain submit`; sbatch_name_pairs,
    with_sbatch_names and job_files read them."""
    group = command.add_argument_group(
        "sbatch's options under their own names",
        "As a job script's #SBATCH lines write them: each sets the job option of the same meaning, the job's name or "
        "files, or is written as an #SBATCH line as given.")
    for option in SBATCH_NAMES:
        text = option.help.replace("%", "%%")  # % is argparse's
        if option.becomes == AS_GIVEN:
            text += f"; written as #SBATCH --{option.name}={option.metavar}"
        group.add_argument(*option.flags, dest=option.dest, type=option.typed, metavar=option.metavar, help=text)


def sbatch_name_pairs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The sbatch names given that are another name of a job option, as slurm.* overrides: --ntasks-per-node N is
    slurm.ranks_per_node N. (A value per task is set by with_sbatch_names, once the tasks per node are known.)"""
    pairs = []
    for option in SBATCH_NAMES:
        value = getattr(args, option.dest, None)
        if value is None or not option.becomes.startswith("slurm."):
            continue
        field = option.becomes.removeprefix("slurm.")
        if getattr(args, field, None) is not None:
            raise ConfigError(f"--{option.name} and --{field.replace('_', '-')} are two ways to set "
                              f"{option.becomes}; give one of them.")
        if not option.per_task:
            pairs.append((option.becomes, str(value)))
    return pairs


def with_sbatch_names(args: argparse.Namespace, slurm: SlurmConfig) -> SlurmConfig:
    """slurm with the sbatch names given applied: a value per task (--cpus-per-task C) as C times the tasks per node,
    and those dptrain has no option for as #SBATCH lines after slurm.sbatch's (gres=gpu:4, nodelist=dgx01)."""
    given = [(option.name, getattr(args, option.dest)) for option in SBATCH_NAMES
             if option.becomes == AS_GIVEN and getattr(args, option.dest, None) is not None]
    for name, value in given:  # checked here, where the option's own name is known (slurm.sbatch's names the line)
        check_sbatch_option(SbatchOption(f"--{name}={value}", f"--{name} {value!r}",
                                         f"give --{name} one word, {ONE_WORD}"))
    lines = tuple(f"{name}={value}" for name, value in given)
    if lines:  # first: GPUs asked for as given (--gres gpu:4) decide the ranks, and so the tasks, per node
        slurm = dataclasses.replace(slurm, sbatch=(*slurm.sbatch, *lines))
    for option in SBATCH_NAMES:
        value = getattr(args, option.dest, None)
        if option.per_task and value is not None:
            field = option.becomes.removeprefix("slurm.")
            slurm = dataclasses.replace(slurm, **{field: value * slurm.tasks_per_node})
    return slurm


def job_files(args: argparse.Namespace) -> dict[str, str | None]:
    """The job's own lines given (--job-name, --output, --error), as slurm.job.job_for takes them."""
    return {"name": getattr(args, "job_name", None), "output": getattr(args, "output", None),
            "error": getattr(args, "error", None)}


def sbatch_name_words(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the words of argv that give an sbatch name, with their values; the others), in their order: `dptrain submit`
    takes --gpus and --gres under their own names, which the tutorials' spellings (spellings.translate) read as
    other commands' options."""
    flags = {flag for option in SBATCH_NAMES for flag in option.flags}
    named: list[str] = []
    rest: list[str] = []
    at = 0
    while at < len(argv):
        word = argv[at]
        flag, eq, _ = word.partition("=")
        if flag in flags:
            takes_next = not eq and at + 1 < len(argv)
            named += argv[at:at + 2] if takes_next else [word]
            at += 2 if takes_next else 1
            continue
        rest.append(word)
        at += 1
    return named, rest
