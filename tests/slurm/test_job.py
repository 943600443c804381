"""Every slurm.* field says what it becomes in the job script (an #SBATCH option, or where the script uses it); the
#SBATCH lines and their checks (slurm/sbatch_lines.py); the CLI's job options are those fields; the requeue after a
stop. The scripts themselves are compared with golden files in tests/slurm/test_submit.py."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

import pytest

from dptrain import config
from dptrain.config import SlurmConfig
from dptrain.errors import ConfigError
from dptrain.config.slurm import SBATCH, SCRIPT_USE
from dptrain.slurm import job as slurm_job, requeue as slurm_requeue, sbatch_lines, script as slurm_script

FIELDS = [f.name for f in dataclasses.fields(SlurmConfig)]
# the fields whose value the script writes as given, one word: --partition=gpu
AS_GIVEN = [f.name for f in dataclasses.fields(SlurmConfig)
            if SBATCH in f.metadata and f.metadata[SBATCH].value is None and f.default is None]


def test_every_slurm_field_is_an_sbatch_option_or_said_not_to_be():
    # A new field saying neither would be silently left out of the job script.
    for f in dataclasses.fields(SlurmConfig):
        assert (SBATCH in f.metadata) != (SCRIPT_USE in f.metadata), f.name
    options = [f.metadata[SBATCH] for f in dataclasses.fields(SlurmConfig) if SBATCH in f.metadata]
    own = [line.of for line in sbatch_lines.JOB_LINES]
    for names in ([o.option for o in options + own], [o.short for o in options + own if o.short],
                  [o.place for o in options + own]):
        assert len(names) == len(set(names))  # one line each, in one place
    assert AS_GIVEN == ["time", "partition", "account", "qos", "constraint", "mem"]


# (what follows #SBATCH, sbatch_reading's verdict: None where sbatch reads it as that one option)
SBATCH_READINGS = [
    ("--partition=gpu", None),
    ("--exclusive", None),
    ("-G8", None),
    ("--gres gpu:4", None),                      # an option and its value, as sbatch also takes them
    ("-G 8", None),
    ("--mail-type\tEND", None),                  # a tab parts words as a space does
    ("--comment=x --job-name=INJECTED", "reads as more than one option"),
    ("--gres=gpu:4 --chdir=/", "reads as more than one option"),
    ("--gres gpu:4 --exclusive", "reads as more than one option"),
    ("--gres --chdir=/", "reads as more than one option"),  # a value that is an option
    ("--comment=x\t--job-name=INJECTED", "reads as more than one option"),
    ("--partition=a\n#SBATCH --job-name=X", "reads as more than one line or option"),
    ("--partition=a\x1b[2J", "reads as more than one line or option"),
    ('--comment="x --job-name=INJECTED"', "reads otherwise than written"),
    ("--comment='x'", "reads otherwise than written"),
    ("--comment=x\\ --job-name=INJECTED", "reads otherwise than written"),
    ("--comment=x#--job-name=INJECTED", "reads otherwise than written"),
    ("--", "does not read as an option"),
    ("---x", "does not read as an option"),
]


@pytest.mark.parametrize("text, reading", SBATCH_READINGS)
def test_an_sbatch_line_is_one_option_or_how_sbatch_would_read_it_instead(text, reading):
    found = sbatch_lines.sbatch_reading(text)
    assert found == reading or (reading is not None and found is not None and found.startswith(reading)), found


def test_every_sbatch_line_of_the_script_is_checked_whatever_its_source(monkeypatch):
    """One check for every #SBATCH line render writes: the job options, the --sbatch lines, the run folder's."""
    checked = []
    monkeypatch.setattr(sbatch_lines, "check_sbatch_option", lambda option: checked.append(option.text))
    pairs = [("data.name", "synthetic"), ("slurm.nodes", "2"), ("slurm.cpus_per_node", "8"),
             ("slurm.gpus_per_node", "2"), ("slurm.time", "01:00:00"), ("slurm.exclusive", "true"), ("slurm.requeue", "true"),
             *((f"slurm.{name}", "x") for name in AS_GIVEN if name != "time")]
    cfg = config.load(None, pairs)
    cfg = dataclasses.replace(cfg, slurm=dataclasses.replace(cfg.slurm, sbatch=("mail-type=END", "-G 4")))
    workdir = Path("/home/ada/project")
    script = slurm_script.render(cfg, slurm_job.job_for(cfg, workdir))
    written = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH")]
    assert checked == written
    assert {"--partition=x", "--exclusive", "--requeue", "--mail-type=END", "-G 4"} <= set(written)


@pytest.mark.parametrize("pairs, sbatch, source", [
    ([("slurm.qos", "high --job-name=X")], (), "slurm.qos = 'high --job-name=X' would be written as "
                                            "'#SBATCH --qos=high --job-name=X'"),
    ([], ("mail-type=END", "gres=gpu:4 --chdir=/"), "slurm.sbatch's line 'gres=gpu:4 --chdir=/' would be written as "
                                                   "'#SBATCH --gres=gpu:4 --chdir=/'"),
    ([("output.dir", "/home/ada/runs/a#b")], (), "the job's name (from the run folder /home/ada/runs/a#b) would be "
                                             "written as '#SBATCH --job-name=dptrain-a#b'"),  # its name, its first line
])
def test_a_value_that_sbatch_would_not_read_as_one_option_is_refused_where_the_script_is_made(pairs, sbatch, source):
    cfg = config.load(None, [("data.name", "synthetic"), *pairs])
    cfg = dataclasses.replace(cfg, slurm=dataclasses.replace(cfg.slurm, sbatch=sbatch))
    workdir = Path("/home/ada/project")
    with pytest.raises(ConfigError) as refused:
        slurm_script.render(cfg, slurm_job.job_for(cfg, workdir))
    message = str(refused.value)
    assert message.startswith(source + ", which sbatch ") and "\n" not in message


@pytest.mark.parametrize("text", [
    "--comment=x", "--comment x", "--comment\tx",                        # one option: read as written
    "--comment=x --job-name=INJECTED", "--comment=x\t--job-name=INJECTED", "--comment x -J INJECTED",
    '--comment="x --job-name=INJECTED"', "--comment='x y'", "--comment=x\\ --job-name=INJECTED", "--comment=x#y",
])
def test_sbatch_reads_as_written_exactly_the_lines_dptrain_lets_through(slurm_cluster, tmp_path, text):
    """sbatch_reading's account of sbatch, asked of the private cluster's real sbatch (a held job, then cancelled): a
    line it lets through is read as the one option written, and sbatch reads every line it refuses otherwise (another
    option, a quote or backslash taken away, the rest of the line cut at a #)."""
    script = tmp_path / "job.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --job-name=dptrain-run\n#SBATCH {text}\ntrue\n")
    done = slurm_cluster.run("sbatch", "--parsable", "--hold", str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip().split(";")[0]
    try:
        record = slurm_cluster.job(int(job_id))
    finally:
        slurm_cluster.run("scancel", job_id)
    written = text.removeprefix("--comment")[1:]  # after the = or the space that parts the option from its value
    as_written = record.get("Comment") == written and record.get("JobName") == "dptrain-run"
    assert as_written == (sbatch_lines.sbatch_reading(text) is None), record


def job_group(command: str) -> dict[str, argparse.Action]:
    """The job options' group of `dptrain submit`, or of `dptrain bench sweep` (the lab parses its own words)."""
    if command == "submit":
        from dptrain.cli import build_parser

        parser = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    else:
        from dptrain_bench.cli import bench_parsers

        parser = bench_parsers()[1][command.removeprefix("bench ")]
    group = next(g for g in parser._action_groups if g.title and g.title.startswith("the job"))
    return {action.dest: action for action in group._group_actions}


@pytest.mark.parametrize("command", ["submit", "bench sweep"])
def test_the_job_options_are_the_slurm_fields_with_their_docstrings(command):
    actions = job_group(command)
    assert list(actions) == FIELDS
    docs, hints = config.field_docs(SlurmConfig), typing.get_type_hints(SlurmConfig)
    for name, action in actions.items():
        assert action.option_strings == ["--" + name.replace("_", "-")]
        assert action.default == ([] if typing.get_origin(hints[name]) is tuple else False if hints[name] is bool else None)
        if not (command == "bench sweep" and name == "nodes"):  # bench's --nodes is the most a point may take
            assert " ".join(docs[name].split()) in action.help


def test_a_requeue_is_recorded_before_scontrol_runs_and_a_refusal_after(monkeypatch):
    events: list[tuple[str, dict]] = []
    monkeypatch.setattr(slurm_requeue, "requeue", lambda job_id: events.append(("scontrol", {"job_id": job_id})) or "denied")
    emit = lambda event, **fields: events.append((event, fields))  # noqa: E731
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv(slurm_requeue.REQUEUE_VAR, raising=False)
    slurm_requeue.requeue_after_stop(7, emit)
    assert events == []  # a job written without --requeue
    monkeypatch.setenv(slurm_requeue.REQUEUE_VAR, "1")
    slurm_requeue.requeue_after_stop(7, emit)
    assert events == [("requeue", {"step": 7, "job_id": "42"}), ("scontrol", {"job_id": "42"}),
                      ("requeue_failed", {"step": 7, "job_id": "42", "reason": "denied"})]


@pytest.mark.parametrize("pattern, name", [
    ("/logs/%x-%j.out", "/logs/fmnist-42.out"),
    ("/logs/%8j.out", "/logs/00000042.out"),    # a width pads the id, as sbatch does
    ("/logs/%%j-%A.out", "/logs/%j-42.out"),    # %% is a %; a job that is no array is its own (%A)
    ("/logs/%N-%j.out", "/logs/%N-42.out"),     # the node is not known at submission: left as written
])
def test_the_log_file_submit_names_is_the_one_sbatch_writes(pattern, name):
    job = slurm_job.Job(Path("/p/runs/run"), Path("/p"), 1, 1, "per-rank", "fmnist", output_file=Path(pattern))
    assert job.output() == Path(pattern)  # the #SBATCH line: the pattern, for sbatch to fill
    assert job.output("42") == job.errors("42") == Path(name)
