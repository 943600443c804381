"""The tutorials' spellings of dptrain's options: read as dptrain's own with a note, dropped where a launcher adds
them, or answered in one sentence; any other unknown option gets the closest option's name."""

from __future__ import annotations

import pytest

from dptrain.cli import main

pytestmark = pytest.mark.usefixtures("no_slurm_clients")  # their submits are dry runs: no SLURM on PATH (conftest)

SMALL = ["--data.name", "synthetic", "--data.synthetic_train_size", "64", "--data.synthetic_test_size", "16",
         "--train.global_batch_size", "32"]


def test_the_tutorials_flags_are_read_as_dptrains_options(tmp_path, capsys):
    assert main(["config", "--data.name", "synthetic", "--epochs", "5", "--learning_rate", "0.01", "--random_seed", "7",
                 "--model_dir", str(tmp_path / "m"), "--model_filename", "net.pth"]) == 0
    out, err = capsys.readouterr()
    assert "epochs = 5" in out and "lr = 0.01" in out and "seed = 7" in out
    # where their scripts save the final model, not the run's folder (which resumed) nor the architecture
    assert f'weights_dir = "{tmp_path / "m"}"' in out and 'weights_file = "net.pth"' in out
    assert '\ndir = ' not in out and 'name = "mnist-cnn"' in out
    assert err.splitlines() == [
        "dptrain: note: --epochs is read as --train.epochs, its name here.",
        "dptrain: note: --learning_rate is read as --optim.lr, its name here.",
        "dptrain: note: --random_seed is read as --train.seed, its name here.",
        "dptrain: note: --model_dir is read as --output.weights_dir, its name here: the final weights are saved there, "
        "as the tutorials' scripts save them; the run's own folder (snapshots, logs, resumed from) stays --output.dir, "
        "runs/<name> by default.",
        "dptrain: note: --model_filename is read as --output.weights_file, its name here: the final weights' file name, "
        "in --output.weights_dir (the run's folder by default)."]


def test_torchruns_underscore_flags_and_a_launchers_local_rank(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # DeepSpeed's launcher runs `python -m dptrain --local_rank=0 train ...`; torchrun users type --nproc_per_node
    assert main(["--local_rank=0", "train", *SMALL, "--nproc_per_node", "2", "--local_rank", "1", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "world      2 local workers on cpu" in out
    assert err.strip() == "dptrain: note: --nproc_per_node is read as --nproc-per-node, its name here."


@pytest.mark.parametrize("flag, sentence", [
    ("--gpus", "--gpus counts GPUs in the tutorials; dptrain starts one worker per GPU: give --nproc-per-node N here, "
               "or --gpus-per-node N to dptrain submit."),
])
def test_a_spelling_with_no_equal_here_is_answered_in_one_sentence(capsys, flag, sentence):
    assert main(["train", flag, "64"]) == 2
    assert capsys.readouterr().err.strip() == f"dptrain: error: {sentence}"


@pytest.mark.parametrize("typed, meant", [("train.epoch", "--train.epochs"), ("optim.learning_rate", "--optim.lr"),
                                          ("num_epoch", "--train.epochs"), ("strategy.ddp.comm_hooks",
                                                                             "--strategy.ddp.comm_hook")])
def test_an_unknown_option_names_the_closest_one(capsys, typed, meant):
    assert main(["config", f"--{typed}", "3"]) == 2
    assert capsys.readouterr().err.strip() == f"dptrain: error: unknown option --{typed}; did you mean {meant}?"


def test_an_option_close_to_none_gets_the_configs_own_sentence(capsys):
    assert main(["config", "--train.zzzz", "3"]) == 2
    assert "unknown option train.zzzz; valid options in [train] are:" in capsys.readouterr().err


def test_help_lists_the_tutorials_spellings(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    flat = " ".join(capsys.readouterr().out.split())
    assert "--epochs, --num_epochs, --num-epochs for --train.epochs" in flat
    assert "--nproc_per_node for --nproc-per-node" in flat and "--local_rank is ignored" in flat


def test_deepspeeds_own_flags_as_its_examples_pass_them(tmp_path, capsys):
    ds = tmp_path / "ds_config.json"
    ds.write_text('{"zero_optimization": {"stage": 2}}')
    assert main(["config", "--data.name", "synthetic", "--epochs=100", "--deepspeed", "--deepspeed_config",
                 str(ds)]) == 0
    out, err = capsys.readouterr()
    assert "epochs = 100" in out and 'name = "deepspeed"' in out and f'config = "{ds}"' in out
    assert "dptrain: note: --deepspeed is read as --strategy.name deepspeed, its name here." in err.splitlines()


def test_sbatchs_gpu_request_as_a_job_script_writes_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--dry-run", *SMALL, "--gres", "gpu:4", "--train.global_batch_size", "64"]) == 0
    out, err = capsys.readouterr()
    assert "#SBATCH --gres=gpu:4" in out and "nccl" in out
    assert err.strip() == ""  # sbatch's --gres is submit's own option now: nothing to translate
    assert main(["submit", "--dry-run", *SMALL, "--gpus-per-task", "1", "--ranks-per-node", "4",
                 "--train.global_batch_size", "64"]) == 0
    out, err = capsys.readouterr()
    assert "#SBATCH --gpus-per-task=1" in out
    assert err.strip() == "dptrain: note: --gpus-per-task 1 is read as --sbatch gpus-per-task=1, its name here."


def test_the_tutorials_batch_per_process_makes_the_global_batch_of_the_world(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *SMALL[:6], "--batch_size", "16", "--nproc-per-node", "2", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "global 32 = 16 per rank" in out
    assert "dptrain: note: --batch_size is read as --train.batch_size_per_rank, its name here." in err
    # with a global batch given too, the two must agree
    assert main(["train", *SMALL[:6], "--train.batch_size_per_rank", "16", "--train.global_batch_size", "48",
                 "--nproc-per-node", "2", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == ("dptrain: error: train.batch_size_per_rank 16 x 2 ranks is a global "
                                               "batch of 32, but train.global_batch_size is 48; give one of the two.")


def test_the_resolved_global_batch_is_saved_with_the_run(tmp_path):
    run = tmp_path / "run"
    assert main(["train", *SMALL[:6], "--train.batch_size_per_rank", "16", "--train.epochs", "1",
                 "--output.dir", str(run)]) == 0
    saved = (run / "config.toml").read_text()
    assert "global_batch_size = 16" in saved and "batch_size_per_rank = 16" in saved


def test_torchruns_multi_node_line_is_read_with_what_dptrain_does_with_each_flag(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # torchrun --nnodes 2 --node_rank 0 --rdzv_backend c10d --rdzv_endpoint HOST:PORT --rdzv_id ID, as the tutorials
    # write it (underscores), then with torchrun's dashed spellings
    for spelled in (["--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:29400", "--rdzv_id", "job42"],
                    ["--rdzv-backend=c10d", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-id=job42"]):
        assert main(["train", *SMALL, "--nnodes", "2", "--node_rank", "0", *spelled, "--dry-run"]) == 0
        out, err = capsys.readouterr()
        assert "2 ranks, 1 local workers on each of 2 nodes (this is node 0)" in out, out
        backend, run_id = spelled[0].partition("=")[0], next(w for w in spelled if "id" in w).partition("=")[0]
        assert (f"dptrain: note: {backend} c10d is the rendezvous dptrain's nodes always use (hosted by node 0 at "
                f"--rdzv-endpoint); nothing to set.") in err.splitlines(), err
        assert (f"dptrain: note: {run_id} job42 is ignored: the rendezvous store that node 0 hosts at --rdzv-endpoint "
                f"serves this one run (a second run at once needs another port), so no run id is needed.") \
            in err.splitlines(), err


@pytest.mark.parametrize("argv, sentence", [
    (["--rdzv_backend", "etcd"], "--rdzv_backend etcd is not a rendezvous dptrain has: its nodes always meet through "
                                 "c10d's, hosted by node 0 at --rdzv-endpoint HOST:PORT; give --rdzv_backend c10d, or "
                                 "leave it out."),
    (["--rdzv-backend=static"], "--rdzv-backend static is not a rendezvous dptrain has"),
    (["--rdzv_id"], "--rdzv_id needs a value, as torchrun's does; write e.g. --rdzv_id job42."),
])
def test_a_rendezvous_dptrain_has_not_is_refused_in_one_sentence(capsys, argv, sentence):
    assert main(["train", *SMALL, "--nnodes", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dptrain: error: {sentence}") and len(err.strip().splitlines()) == 1, err
