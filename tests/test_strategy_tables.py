"""Each strategy's options sit in its own table ([strategy.ddp], ...); the flat keys of before are read for one
release, with one note; a snapshot written before the tables still resumes.

tests/fixtures/before-strategy-tables/ was written by the code of commit f97908d (before the tables), as
  PYTHONPATH=<that commit's src>:. python -m dptrain train --nproc-per-node 1 --strategy.name zero1
      --strategy.comm_hook fp16 --data.name synthetic --data.synthetic_train_size 64 --data.synthetic_test_size 16
      --model.name tests.user_code:TinyNet --optim.name sgd --optim.momentum 0 --train.global_batch_size 32
      --train.epochs 2 --train.max_steps 2 --launch.device cpu --output.dir /tmp/oldrun/run
and holds its config.toml (flat [strategy] keys) and its snapshot of step 2 (manifest options under the flat names,
the optimizer in optimizer.pt, no "parts" record).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from dptrain import config
from dptrain.config import RunConfig
from dptrain.errors import ConfigError
from dptrain.safe_load import make_private
from tests.conftest import log_tail

BEFORE = Path(__file__).parent / "fixtures" / "before-strategy-tables"
NEW_KEYS = [("strategy.name", "zero1"), ("strategy.ddp.comm_hook", "fp16"), ("strategy.ddp.powersgd_rank", "2")]


def notes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "its own table" in r.getMessage()]


def test_a_strategys_options_are_set_in_its_table_in_toml_and_on_the_command_line(tmp_path):
    from_cli = config.load(None, NEW_KEYS)
    assert (from_cli.strategy.ddp.comm_hook, from_cli.strategy.ddp.powersgd_rank) == ("fp16", 2)
    toml = tmp_path / "run.toml"
    toml.write_text('[strategy]\nname = "zero1"\n[strategy.ddp]\ncomm_hook = "fp16"\npowersgd_rank = 2\n')
    assert config.load(toml) == from_cli
    assert config.load(tmp_path / "run.toml", [("strategy.ddp.comm_hook", "bf16")]).strategy.ddp == \
        config.DDPOptions(comm_hook="bf16", powersgd_rank=2)  # the command line wins, option by option
    written = config.to_toml(from_cli)
    assert "[strategy.ddp]\ncomm_hook = \"fp16\"" in written
    toml.write_text(written)
    assert config.load(toml) == from_cli
    assert "--strategy.ddp.comm_hook {allreduce,fp16,bf16,powersgd,ring}" in config.options_help()["strategy.ddp"]


@pytest.mark.parametrize(("pairs", "refusal"), [
    ([("strategy.ddp.nope", "1")], "unknown option strategy.ddp.nope; valid options in \\[strategy.ddp\\] are: "
                                   "comm_hook, shared_memory, powersgd_rank"),
    ([("strategy.ddp", "fp16")], "\\[strategy.ddp\\] must be a table of options"),
    ([("strategy.ddp.comm_hook.x", "1")], "is not of the form --section.option"),
    ([("strategy.comm_hook", "fp16"), ("strategy.ddp.comm_hook", "bf16")], "strategy.comm_hook and "
                                                                           "strategy.ddp.comm_hook are the same option"),
])
def test_a_wrong_table_option_is_one_sentence(pairs, refusal):
    with pytest.raises(ConfigError, match=refusal):
        config.load(None, pairs)


def test_the_old_flat_keys_are_read_as_their_tables_with_one_note(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="dptrain")
    old = config.load(None, [("strategy.name", "zero1"), ("strategy.comm_hook", "fp16"), ("strategy.powersgd_rank", "2")])
    assert old == config.load(None, NEW_KEYS)
    assert notes(caplog) == ["each strategy's options now sit in its own table; read as the new keys, which to write "
                             "instead (the old ones are read for one release only): strategy.comm_hook -> "
                             "strategy.ddp.comm_hook, strategy.powersgd_rank -> strategy.ddp.powersgd_rank"]
    caplog.clear()
    from_file = config.load(BEFORE / "config.toml", [("strategy.deepspeed_config", "none")])
    assert from_file.strategy.ddp.comm_hook == "fp16" and from_file.strategy.name == "zero1"
    assert len(notes(caplog)) == 1 and "strategy.zero_stage -> strategy.deepspeed.zero_stage" in notes(caplog)[0]
    assert "strategy.deepspeed_config -> strategy.deepspeed.config" in notes(caplog)[0]
    caplog.clear()
    assert config.from_dict({"strategy": {"name": "ps", "dedicated_server": True}}).strategy.ps.dedicated_server
    assert len(notes(caplog)) == 1
    caplog.clear()
    config.load(None, NEW_KEYS)
    assert notes(caplog) == []  # the new keys: no note


def test_the_resume_rule_of_an_option_sits_on_its_field():
    fixed = config.fixed_at_resume(RunConfig())
    assert "strategy.ddp.comm_hook" in fixed and "strategy.deepspeed.zero_stage" in fixed
    assert not {"strategy.deepspeed.config", "train.epochs", "launch.device", "output.dir"} & set(fixed)
    assert not any(name.startswith(("checkpoint.", "slurm.")) for name in fixed)
    assert config.current_name("strategy.comm_hook") == "strategy.ddp.comm_hook"
    assert config.current_name("strategy.deepspeed_config (sha256 of its settings)") == \
        "strategy.deepspeed.config (sha256 of its settings)"
    assert config.current_name("optim.lr") == "optim.lr"


def test_every_builtin_dataset_and_model_is_a_configs_choice():
    from dptrain.data.catalog import DATASETS
    from dptrain.models import MODELS

    assert set(config.DATASET_NAMES) == {*DATASETS, "synthetic"}  # synthetic is generated, not read (data.synthetic)
    assert set(config.MODEL_NAMES) == set(MODELS)


def copy_of_the_old_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(BEFORE / "step-00000002", run_dir / "checkpoints" / "step-00000002")
    make_private(run_dir / "checkpoints" / "step-00000002")
    return run_dir


def test_a_snapshot_written_before_the_strategy_tables_resumes(tmp_path, capsys):
    from dptrain.cli import main

    run_dir = copy_of_the_old_run(tmp_path)
    args = ["--nproc-per-node", "1", "--output.dir", str(run_dir), "--train.max_steps", "4"]
    assert main(["train", "--config", str(BEFORE / "config.toml"), *args]) == 0, capsys.readouterr().err
    assert "resumed from" in log_tail(run_dir) and "at step 2" in log_tail(run_dir), log_tail(run_dir)
    assert (run_dir / "checkpoints" / "step-00000004").is_dir()

    # The same snapshot, the run given with the new keys; and refused where an option it records changed.
    again = copy_of_the_old_run(tmp_path / "again")
    new = ["--strategy.name", "zero1", "--strategy.ddp.comm_hook", "fp16", "--data.name", "synthetic",
           "--data.synthetic_train_size", "64", "--data.synthetic_test_size", "16", "--model.name",
           "tests.user_code:TinyNet", "--optim.name", "sgd", "--optim.momentum", "0", "--train.global_batch_size", "32",
           "--train.epochs", "2", "--launch.device", "cpu", "--nproc-per-node", "1", "--output.dir", str(again)]
    assert main(["train", *new, "--train.max_steps", "3", "--strategy.ddp.comm_hook", "allreduce"]) == 1
    assert "was written with strategy.ddp.comm_hook = 'fp16' but this run has 'allreduce'" in capsys.readouterr().err
    assert main(["train", *new, "--train.max_steps", "3"]) == 0, capsys.readouterr().err
    assert "at step 2" in log_tail(again) and (again / "checkpoints" / "step-00000003").is_dir()


def test_a_record_of_before_the_tables_compares_equal_once_upgraded():
    """bench/sweep: a sweep recorded before the tables resumes; its sweep.json's config says strategy.comm_hook."""
    new = config.to_dict(config.load(None, [("strategy.ddp.comm_hook", "fp16")]))
    old = {**new, "strategy": {"name": "ddp", "comm_hook": "fp16", "shared_memory": True, "powersgd_rank": 4,
                               "reshard_after_forward": True, "param_dtype": "auto", "reduce_dtype": "auto",
                               "dedicated_server": False, "zero_stage": 2, "deepspeed_config": None}}
    assert old != new and config.upgraded(old) == new
    assert config.upgraded(None) is None
