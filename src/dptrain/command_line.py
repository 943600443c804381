"""What the commands' command lines share: the --section.option VALUE pairs, and the job's options (one per field of
SlurmConfig) that `dptrain submit` and the lab's `dptrain bench --slurm` take. Below the commands, so that the
measuring lab builds its command lines from here without importing `dptrain.cli` (which imports the launchers).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Literal

from dptrain import config as config_mod, spellings
from dptrain.config import SlurmConfig
from dptrain.errors import ConfigError


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
    """The job's options, shared by submit and bench --slurm: one per field of SlurmConfig (--gpus-per-node sets
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
