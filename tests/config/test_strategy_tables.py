"""Each strategy's options sit in its own table ([strategy.ddp], ...); the flat keys of before (never released) are
refused, each with its new spelling; a snapshot written before the tables still resumes.

tests/fixtures/before-strategy-tables/ was written by the code of commit f97908d (before the tables), as
  PYTHONPATH=<that commit's src>:. python -m dptrain train --nproc-per-node 1 --strategy.name zero1
      --strategy.comm_hook fp16 --data.name synthetic --data.synthetic_train_size 64 --data.synthetic_test_size 16
      --model.name tests.user_code:TinyNet --optim.name sgd --optim.momentum 0 --train.global_batch_size 32
      --train.epochs 2 --train.max_steps 2 --launch.device cpu --output.dir /tmp/oldrun/run
and holds its config.toml (flat [strategy] keys) and its snapshot of step 2 (manifest options under the flat names,
the optimizer in optimizer.pt, no "parts" record).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dptrain import config
from dptrain.config import RunConfig
from dptrain.errors import ConfigError
from dptrain.safe_load import make_private
from dptrain.strategies.ddp.options import DDPOptions
from tests.conftest import log_tail

BEFORE = Path(__file__).parents[1] / "fixtures" / "before-strategy-tables"
NEW_KEYS = [("strategy.name", "zero1"), ("strategy.ddp.comm_hook", "fp16"), ("strategy.ddp.powersgd_rank", "2")]


def test_a_strategys_options_are_set_in_its_table_in_toml_and_on_the_command_line(tmp_path):
    from_cli = config.load(None, NEW_KEYS)
    assert (from_cli.strategy.ddp.comm_hook, from_cli.strategy.ddp.powersgd_rank) == ("fp16", 2)
    toml = tmp_path / "run.toml"
    toml.write_text('[strategy]\nname = "zero1"\n[strategy.ddp]\ncomm_hook = "fp16"\npowersgd_rank = 2\n')
    assert config.load(toml) == from_cli
    assert config.load(tmp_path / "run.toml", [("strategy.ddp.comm_hook", "bf16")]).strategy.ddp == \
        DDPOptions(comm_hook="bf16", powersgd_rank=2)  # the command line wins, option by option
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
])
def test_a_wrong_table_option_is_one_sentence(pairs, refusal):
    with pytest.raises(ConfigError, match=refusal):
        config.load(None, pairs)


def test_the_old_flat_keys_are_refused_with_their_new_spelling(tmp_path):
    """No release ever read them: one sentence names the table's key to write instead, on the command line, in a
    file and in a tree alike."""
    with pytest.raises(ConfigError) as refused:
        config.load(None, [("strategy.name", "zero1"), ("strategy.comm_hook", "fp16")])
    assert str(refused.value) == ("--strategy.comm_hook is no option: each strategy's options sit in its own table; "
                                  "write --strategy.ddp.comm_hook instead.")
    with pytest.raises(ConfigError) as refused:
        config.load(BEFORE / "config.toml")
    assert str(refused.value) == ("strategy.comm_hook is no option: each strategy's options sit in its own table; write "
                                  "strategy.ddp.comm_hook instead.")
    with pytest.raises(ConfigError, match="write --strategy.deepspeed.config instead"):
        config.load(None, [("strategy.deepspeed_config", "none")])
    with pytest.raises(ConfigError, match="write strategy.ps.dedicated_server instead"):
        config.from_dict({"strategy": {"name": "ps", "dedicated_server": True}})
    assert config.load(None, NEW_KEYS).strategy.ddp.comm_hook == "fp16"  # the new keys are read


def test_the_resume_rule_of_an_option_sits_on_its_field():
    fixed = config.fixed_at_resume(RunConfig())
    assert "strategy.ddp.comm_hook" in fixed and "strategy.deepspeed.zero_stage" in fixed
    assert not {"strategy.deepspeed.config", "train.epochs", "launch.device", "output.dir"} & set(fixed)
    assert not any(name.startswith(("checkpoint.", "slurm.")) for name in fixed)
    assert config.current_name("strategy.comm_hook") == "strategy.ddp.comm_hook"
    assert config.current_name("strategy.deepspeed_config (sha256 of its settings)") == \
        "strategy.deepspeed.config (sha256 of its settings)"
    assert config.current_name("optim.lr") == "optim.lr"


def test_the_builtin_datasets_and_models_are_config_choices_tables():
    """config.choices is the one list of them: data and models build their tables from it, in its order; each entry
    names the spec or class it is (a dataset's spec says its own name)."""
    from dptrain.config import choices
    from dptrain.data.catalog import DATASETS
    from dptrain.models import INPUTS, MODELS
    from dptrain.models.mnist_cnn import MnistCNN

    assert config.DATASET_NAMES == (*choices.DATASETS, choices.SYNTHETIC)  # synthetic is generated, not read
    assert list(DATASETS) == list(choices.DATASETS) and all(spec.name == name for name, spec in DATASETS.items())
    assert config.MODEL_NAMES == tuple(MODELS) == tuple(choices.MODELS)
    assert INPUTS["mnist-cnn"] == (1, (28, 28)) and isinstance(MODELS["mnist-cnn"]((1, 28, 28), 10), MnistCNN)


def copy_of_the_old_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(BEFORE / "step-00000002", run_dir / "checkpoints" / "step-00000002")
    make_private(run_dir / "checkpoints" / "step-00000002")
    return run_dir


@pytest.mark.slow
def test_a_snapshot_written_before_the_strategy_tables_resumes(tmp_path, capsys):
    from dptrain.cli import main

    # The snapshot, the run given with the new keys (its config.toml's flat keys are refused: test above); and
    # refused where an option it records changed.
    again = copy_of_the_old_run(tmp_path)
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
