"""slurm/job.py's table of sbatch options covers every slurm.* field; the CLI's job options are those fields; the
requeue after a stop. The scripts themselves are compared with golden files in tests/launch/test_submit.py."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from dptrain import config
from dptrain.config import SlurmConfig
from dptrain.slurm import job as slurm_job

FIELDS = [f.name for f in dataclasses.fields(SlurmConfig)]


def test_every_slurm_field_is_an_sbatch_option_or_said_not_to_be():
    # A new field in neither table would be silently left out of the job script.
    assert sorted(FIELDS) == sorted([*slurm_job.SBATCH_OPTIONS, *slurm_job.NOT_SBATCH_OPTIONS])
    assert set(slurm_job.AS_GIVEN) <= set(slurm_job.SBATCH_OPTIONS)


def test_the_options_written_as_given_are_refused_with_a_space():
    # Written as `#SBATCH --partition=VALUE`: a space in VALUE would start another sbatch option.
    assert set(slurm_job.AS_GIVEN) <= set(config.SLURM_WORDS)


def job_group(command: str) -> dict[str, argparse.Action]:
    from dptrain.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    group = next(g for g in commands[command]._action_groups if g.title and g.title.startswith("the job"))
    return {action.dest: action for action in group._group_actions}


@pytest.mark.parametrize("command", ["submit", "bench"])
def test_the_job_options_are_the_slurm_fields_with_their_docstrings(command):
    actions = job_group(command)
    assert list(actions) == FIELDS
    docs, hints = config.field_docs(SlurmConfig), typing.get_type_hints(SlurmConfig)
    for name, action in actions.items():
        assert action.option_strings == ["--" + name.replace("_", "-")]
        assert action.default == ([] if typing.get_origin(hints[name]) is tuple else False if hints[name] is bool else None)
        if not (command == "bench" and name == "nodes"):  # bench's --nodes is the most a point may take
            assert " ".join(docs[name].split()) in action.help


def test_a_requeue_is_recorded_before_scontrol_runs_and_a_refusal_after(monkeypatch):
    events: list[tuple[str, dict]] = []
    monkeypatch.setattr(slurm_job, "requeue", lambda job_id: events.append(("scontrol", {"job_id": job_id})) or "denied")
    emit = lambda event, **fields: events.append((event, fields))  # noqa: E731
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv(slurm_job.REQUEUE_VAR, raising=False)
    slurm_job.requeue_after_stop(7, emit)
    assert events == []  # a job written without --requeue
    monkeypatch.setenv(slurm_job.REQUEUE_VAR, "1")
    slurm_job.requeue_after_stop(7, emit)
    assert events == [("requeue", {"step": 7, "job_id": "42"}), ("scontrol", {"job_id": "42"}),
                      ("requeue_failed", {"step": 7, "job_id": "42", "reason": "denied"})]
