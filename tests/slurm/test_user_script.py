"""`dptrain submit -- my_train.py ...`: a training script of the user's own in dptrain's job, under one torchrun per
node (src/dptrain/slurm/user_script.py). The script's lines and the refusals here; the job on a real scheduler is in
test_slurm_jobs.py."""

from __future__ import annotations

import sys

import pytest

pytestmark = pytest.mark.usefixtures("no_slurm_clients")  # their submits are dry runs: no SLURM on PATH (conftest)

SCRIPT = "my_train.py"


@pytest.fixture
def submit(tmp_path, monkeypatch, capsys):
    """`dptrain submit ARGS` in this process, from tmp_path, which holds my_train.py: (exit code, stdout, stderr)."""
    from dptrain.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / SCRIPT).write_text("print('training')\n")

    def call(*args: str) -> tuple[int, str, str]:
        code = main(["submit", *args])
        out, err = capsys.readouterr()
        return code, out, err

    return call


def test_a_users_script_runs_under_one_torchrun_per_node_with_rank_0_on_the_first_node(submit, tmp_path):
    code, out, err = submit("--dry-run", "--nodes", "2", "--gres", "gpu:4", "--cpus-per-task", "8", "--time",
                            "01:00:00", "--", "python", SCRIPT, "--epochs", "5", "--batch_size", "64")
    assert code == 0, err
    assert err == ""  # the script's --batch_size is its own: no note that dptrain read it as its option
    lines = out.splitlines()
    run_dir = tmp_path / "runs" / "my_train"  # named after the script
    assert lines[1] == (f"# {SCRIPT}'s training (torchrun) of runs/my_train: 2 nodes x 4 ranks (one elastic agent "
                        "per node, nccl on GPUs).")
    sbatch = [line for line in lines if line.startswith("#SBATCH")]
    assert sbatch == ["#SBATCH --job-name=dptrain-my_train", "#SBATCH --nodes=2",
                      "#SBATCH --ntasks-per-node=1",  # one task per node: torchrun
                      "#SBATCH --cpus-per-task=8",  # per task, as the tutorials write it: the one torchrun
                      "#SBATCH --time=01:00:00", f"#SBATCH --chdir={tmp_path}",
                      f"#SBATCH --output={run_dir}/logs/slurm-%j.out", f"#SBATCH --error={run_dir}/logs/slurm-%j.err",
                      "#SBATCH --open-mode=append", "#SBATCH --gres=gpu:4"]  # no --signal: the script did not ask
    assert "export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))" in lines
    assert "export OMP_NUM_THREADS=2" in lines  # the node's 8 cores shared by its 4 ranks
    # each task's bash reads its own node's SLURM_NODEID (the batch shell's is the first node's)
    assert lines[-1] == ('srun --kill-on-bad-exit=1 bash -c \'exec python -m torch.distributed.run --nnodes 2 '
                         '--nproc-per-node 4 --node-rank "$SLURM_NODEID" --master-addr "$MASTER_ADDR" --master-port '
                         f'"$MASTER_PORT" {SCRIPT} --epochs 5 --batch_size 64\'')
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


def test_a_users_script_asking_for_the_signal_and_requeue_gets_them_through_torchrun(submit):
    code, out, err = submit("--dry-run", "--requeue", "--signal-lead-s", "300", "--output.name", "mine", "--",
                            "-m", "mypackage.train", "--lr", "0.1")
    assert code == 0, err
    assert "#SBATCH --signal=USR1@300\n#SBATCH --requeue\n" in out
    assert "export DPTRAIN_REQUEUE=1" in out
    # torchrun passes SIGUSR1 on to the script's ranks instead of dying of it; this Python runs it by default
    assert out.splitlines()[-1] == (
        f'srun --kill-on-bad-exit=1 bash -c \'exec {sys.executable} -m torch.distributed.run --nnodes 1 '
        '--nproc-per-node 1 --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --node-rank "$SLURM_NODEID" '
        '--master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" -m mypackage.train --lr 0.1\'')


def test_a_script_that_reads_slurms_variables_runs_as_one_srun_task_per_rank_with_mode_per_rank(submit, tmp_path):
    """Issue 42: a script that takes its rank from SLURM_PROCID and SLURM_NTASKS read, under one torchrun per node,
    its node's one task (each rank a world of its own, silently); with --mode per-rank each task is one rank, and
    torchrun's variables are set from SLURM's, so either kind of script reads the same ranks."""
    code, out, err = submit("--dry-run", "--nodes", "2", "--ranks-per-node", "4", "--cpus-per-node", "8", "--mode",
                            "per-rank", "--", "python", SCRIPT, "--epochs", "5")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1] == f"# {SCRIPT}'s training of runs/my_train: 2 nodes x 4 ranks (one srun task per rank, gloo on CPUs)."
    assert "#SBATCH --ntasks-per-node=4" in lines and "#SBATCH --cpus-per-task=2" in lines  # per rank
    assert "export OMP_NUM_THREADS=2" in lines and "#SBATCH --signal" not in out  # the script did not ask for one
    assert lines[-1] == ('srun --kill-on-bad-exit=1 bash -c \'export RANK="$SLURM_PROCID" LOCAL_RANK="$SLURM_LOCALID" '
                         'WORLD_SIZE="$SLURM_NTASKS" LOCAL_WORLD_SIZE=4; exec python my_train.py --epochs 5\'')
    # without the option, one torchrun per node, and the script says which option a SLURM-variable script wants
    code, out, err = submit("--dry-run", "--nodes", "2", "--ranks-per-node", "4", "--", "python", SCRIPT)
    assert code == 0 and "torch.distributed.run" in out.splitlines()[-1] and "--mode per-rank" in out


def test_a_signal_lead_in_the_config_files_slurm_table_is_asked_for_too(submit, tmp_path):
    (tmp_path / "job.toml").write_text("[slurm]\nsignal_lead_s = 300\n")
    code, out, err = submit("--dry-run", "--config", "job.toml", "--", SCRIPT)
    assert code == 0, err
    assert "#SBATCH --signal=USR1@300\n" in out and "--signals-to-handle" in out


@pytest.mark.parametrize("args, error", [
    (["--"], "no training script after --; give the script and its arguments as torchrun takes them, e.g. dptrain "
             "submit --nodes 2 -- my_train.py --epochs 5."),
    (["--", "python"], "no training script after --; give the script and its arguments as torchrun takes them, e.g. "
                       "dptrain submit --nodes 2 -- my_train.py --epochs 5."),
    (["--", "train.py"], "the training script train.py is not a file in {tmp}, where the job runs it; give its "
                         "path from there."),
    (["--optim.lr", "0.1", "--", SCRIPT], "--optim.lr is an option of dptrain's own trainer, which this job does not "
                                          "run; give your script its own options after its name (-- my_train.py "
                                          "--epochs 5)."),
    (["--", "--nproc_per_node", "2", SCRIPT], "--nproc_per_node after -- is an option, not a training script; put "
                                              "dptrain submit's options before --, and the script and its arguments "
                                              "after it, e.g. dptrain submit --nodes 2 -- my_train.py --epochs 5."),
])
def test_what_a_users_script_cannot_be_given_is_one_sentence(submit, tmp_path, args, error):
    code, out, err = submit("--dry-run", *args)
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == "dptrain: error: " + error.format(tmp=tmp_path)
