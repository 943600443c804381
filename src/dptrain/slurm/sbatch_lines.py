"""The #SBATCH lines of a job's script. One rule writes them (sbatch_options): each slurm.<field> that an #SBATCH
option carries says so in its metadata (config.slurm.SbatchOf: the option, its one-letter form, its place, its value
in the job), the job's own lines (its name, folder and files: JOB_LINES) take their places among them, and the user's
--sbatch lines follow. Every line, whatever its source, is checked in one place (check_sbatch_option): sbatch must
read it as the one option written, never as more. An --sbatch line may not repeat an option dptrain writes itself
(check_extra_line): sbatch would take the last of the two, and the job would be another than dptrain planned.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable

from dptrain.config import SlurmConfig
from dptrain.config.slurm import GPU_SBATCH_OPTIONS, SBATCH, SbatchOf
from dptrain.errors import ConfigError
from dptrain.slurm.job import Job

# sbatch reads what follows #SBATCH as words of its command line, as slurm 22.05's sbatch was seen to: split at spaces
# and tabs, quotes (' and ") joining words, a backslash dropped, and # starting a comment that ends the line. So
# `--sbatch 'comment=x --job-name=INJECTED'` ran as INJECTED, and `comment=x#y` lost its y. Every #SBATCH line the
# script holds is one option (check_sbatch_option checks them all, whatever their source): one word, or an option and
# its value, and none of those characters, whose reading may differ between SLURM versions.
SBATCH_OWN_SYNTAX = "\"'\\#"
SBATCH_OPTION = re.compile(r"--[A-Za-z][A-Za-z0-9-]*(=\S*)?|-[A-Za-z]\S*")  # one word: --name, --name=value, -G8
SBATCH_OPTION_NAME = re.compile(r"--[A-Za-z][A-Za-z0-9-]*|-[A-Za-z]")  # the first of two: --gres gpu:4, -G 8
PATH_REMEDY = "choose a plain path (--output.dir, or submit from another folder)"
ONE_WORD = "without spaces, quotes, backslashes or #"
WORD_REMEDY = f"give one word, as sbatch takes it, {ONE_WORD} (other sbatch options go in slurm.sbatch)"
LINE_REMEDY = ("give each option its own --sbatch line, as --sbatch NAME=VALUE with no space, quote, backslash or # in "
               "VALUE")


@dataclass(frozen=True)
class JobLine:
    """An #SBATCH line of the job itself, which no slurm.* field gives: its option (as SbatchOf), its value, its
    source and what to do where sbatch would not read it as written (as an error names them) in a job, and what a
    user who wants another value does instead (advice that ends a sentence)."""

    of: SbatchOf
    value: Callable[[Job], object]
    source: Callable[[Job], str]
    remedy: Callable[[Job], str]
    instead: str


def _file_line(stream: str, given: Callable[[Job], object]) -> tuple[Callable[[Job], str], Callable[[Job], str]]:
    """The source of the job's output or error line and its remedy, as an error names them: the file given
    (--output), or the run's."""
    return (lambda job: (f"the job's {stream} file (--{stream})" if given(job)
                         else f"the job's {stream} file (in the run folder {job.run_dir})"),
            lambda job: f"give --{stream} a plain path, {ONE_WORD}" if given(job) else PATH_REMEDY)


JOB_LINES = (
    JobLine(SbatchOf("--job-name", 0, "-J"), lambda job: job.name,
            lambda job: f"the job's name (from the run folder {job.run_dir})" if job.named_after_its_run
            else "the job's name (--job-name)",
            lambda job: PATH_REMEDY if job.named_after_its_run else f"give --job-name one word, {ONE_WORD}",
            "give dptrain submit's --job-name NAME instead"),
    JobLine(SbatchOf("--chdir", 12, "-D"), lambda job: job.workdir,
            lambda job: f"the folder dptrain submit runs in ({job.workdir})",
            lambda job: "submit from another folder, with a plain path",
            "run dptrain submit from the folder the job is to run in instead"),
    JobLine(SbatchOf("--output", 13, "-o"), lambda job: job.output(),
            *_file_line("output", lambda job: job.output_file), "give dptrain submit's --output FILE instead"),
    JobLine(SbatchOf("--error", 14, "-e"), lambda job: job.errors(),
            *_file_line("error", lambda job: job.error_file or job.output_file),
            "give dptrain submit's --error FILE instead"),
    # a requeued job keeps writing to the same files
    JobLine(SbatchOf("--open-mode", 15), lambda job: "append", lambda job: "the job's --open-mode",
            lambda job: PATH_REMEDY,
            "leave it out: dptrain appends, so that a requeued job writes on at the end of its files"),
)


@dataclass(frozen=True)
class SbatchOption:
    """What one #SBATCH line of the script carries (--partition=gpu), where it comes from as an error names it, and
    what to do where sbatch would not read it as that one option."""

    text: str
    source: str
    remedy: str = PATH_REMEDY


def sbatch_options(s: SlurmConfig, job: Job) -> list[SbatchOption]:
    """The script's #SBATCH options, in its order, each checked (check_sbatch_option) before anything is written:
    the fields' and the job's own by their places, then slurm.sbatch's lines as given."""
    placed: list[tuple[int, SbatchOption]] = []
    for line in JOB_LINES:
        placed.append((line.of.place, SbatchOption(f"{line.of.option}={line.value(job)}", line.source(job),
                                                    line.remedy(job))))
    for field in dataclasses.fields(SlurmConfig):
        of: SbatchOf | None = field.metadata.get(SBATCH)
        value = None if of is None else of.of(s, field.name)
        if of is None or value is None or value is False:
            continue
        if value is True:  # a flag
            placed.append((of.place, SbatchOption(of.option, f"slurm.{field.name}")))
        elif of.value is None and isinstance(value, str):  # passed through as given: one word
            placed.append((of.place, SbatchOption(f"{of.option}={value}", f"slurm.{field.name} = {value!r}",
                                                  WORD_REMEDY)))
        else:  # worked out from the job's shape
            placed.append((of.place, SbatchOption(f"{of.option}={value}", f"slurm.{field.name}", WORD_REMEDY)))
    options = [option for _, option in sorted(placed, key=lambda pair: pair[0])]
    for extra in s.sbatch:
        check_extra_line(extra)
        options.append(SbatchOption(extra if extra.startswith("-") else "--" + extra, f"slurm.sbatch's line {extra!r}",
                                    LINE_REMEDY))
    for option in options:
        check_sbatch_option(option)
    return options


def own_options() -> dict[str, tuple[str, str]]:
    """sbatch's name (ntasks-per-node) and one-letter form (N) of every option dptrain writes itself -> (the option,
    what to do instead, as the end of a sentence); the GPU options, which an --sbatch line may ask with (gres=gpu:4),
    left out."""
    owned: dict[str, tuple[str, str]] = {}
    for field in dataclasses.fields(SlurmConfig):
        of = field.metadata.get(SBATCH)
        if of is not None and of.option.removeprefix("--") not in GPU_SBATCH_OPTIONS:
            owned.update(_names(of, f"give --{field.name.replace('_', '-')} (slurm.{field.name}) instead"))
    for line in JOB_LINES:
        owned.update(_names(line.of, line.instead))
    return owned


def _names(of: SbatchOf, instead: str) -> dict[str, tuple[str, str]]:
    names = {of.option.removeprefix("--"): (of.option, instead)}
    if of.short is not None:
        names[of.short.removeprefix("-")] = (of.short, instead)
    return names


def check_extra_line(line: str) -> None:
    """ConfigError in one sentence for an --sbatch line that sets an option dptrain writes itself (ntasks-per-node=4,
    -J x, output=...), naming the option to give instead, or that names a one-letter option without its dash
    (w=dgx01: written as --w=dgx01, which sbatch reads as no option, or as another)."""
    words = line.split()
    if not words:
        return  # check_sbatch_option says what is wrong with it
    word = words[0]
    if word.startswith("--"):
        name = word[2:].partition("=")[0]
    elif word.startswith("-"):
        name = word[1:2]  # -N2, -N 2: one letter
    else:
        name = word.partition("=")[0]
        if len(name) == 1:
            raise ConfigError(f"slurm.sbatch's line {line!r} is sbatch's one-letter option -{name} without its dash, "
                              f"which sbatch would not read as -{name} (written as '#SBATCH --{line}'); write it as "
                              f"'-{name} VALUE', or by the option's long name (NAME=VALUE).")
    owned = own_options().get(name)
    if owned is not None:
        option, instead = owned
        raise ConfigError(f"slurm.sbatch's line {line!r} sets sbatch's {option}, which dptrain writes itself; "
                          f"{instead}.")


def check_sbatch_option(option: SbatchOption) -> None:
    """ConfigError in one sentence where sbatch would not read `#SBATCH <option.text>` as the one option written."""
    reading = sbatch_reading(option.text)
    if reading is not None:
        raise ConfigError(f"{option.source} would be written as {'#SBATCH ' + option.text!r}, which sbatch {reading}; "
                          f"{option.remedy}.")


def sbatch_reading(text: str) -> str | None:
    """None where sbatch reads `#SBATCH <text>` as one option: one word (--partition=gpu, --exclusive, -G8) or an
    option and its value (--gres gpu:4, -G 8, as a user's --sbatch line may write them); else how sbatch reads it
    instead, as the end of a sentence."""
    if any(not c.isprintable() and c != "\t" for c in text):  # a tab parts words, as a space does
        return "reads as more than one line or option (it holds a line break or another control character)"
    if any(c in SBATCH_OWN_SYNTAX for c in text):
        return "reads otherwise than written (quotes and backslashes are its own syntax there, and # starts a comment)"
    words = text.split()
    if len(words) == 1 and SBATCH_OPTION.fullmatch(words[0]):
        return None
    if len(words) == 2 and SBATCH_OPTION_NAME.fullmatch(words[0]) and not words[1].startswith("-"):
        return None
    return "reads as more than one option" if len(words) > 1 else "does not read as an option"
