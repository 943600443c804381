"""docs/from-the-tutorials.md followed literally: every `dptrain ...` command on it runs as written, and every output it
shows (a note, a sample line, a refusal sentence) is what the command prints.

Each command runs in a fresh folder, in this process through `dptrain.cli.main`, with what it needs there: small
FashionMNIST IDX files under ./data (tests/idx_files.py; the default dataset, found first in --data.root), the
tutorials' training script for `submit -- train.py` and `train -- train.py`, a ds_config.json for `--deepspeed_config`. `--dry-run` is added
to every `dptrain train` (each would start real training, several processes) and every `dptrain submit` (each would
submit a real job): a dry run makes every check a run makes (the configuration, the data, the world size, the batch,
the nodes, the job's options) and writes nothing, so a command the page shows would be refused fails here. The one
thing a dry run cannot show, the files a real `submit` writes and the `tail -f` line it prints, is checked on the
private SLURM cluster (tests/slurm_cluster.py), the jobs held and cancelled. The page's multi-node line runs "on
node1", as the page says: here node1 resolves to this host. A command the prose only names (`dptrain submit` writes
...) runs as its bare dry run. The table of their files is checked on one process training 2 steps, in this process.

What this leaves out: the runs of several processes (every rank's line with --output.rank_epoch_lines: see
tests/metrics/test_epoch_lines.py), the GPU logs, and the cluster (tests/slurm/, tutorial_ddp.py among them).
"""

from __future__ import annotations

import logging
import re
import socket

import pytest
import torch

from dptrain import config as config_mod
from dptrain.cli import main
from dptrain.prestart import resolve_batch
from tests.idx_files import write_idx_dataset
from tests.test_docs_commands import ROOT, Command, read_page

pytestmark = pytest.mark.usefixtures("no_slurm_clients")  # their submits are dry runs: no SLURM on PATH (conftest)

PAGE = ROOT / "docs" / "from-the-tutorials.md"
COMMANDS, PAGE_FILES = read_page(PAGE)
TRAIN_SIZE, TEST_SIZE = 512, 64
# The tutorials' DDP script, as `dptrain submit ... -- train.py` finds it in the folder the job runs in.
TUTORIAL_SCRIPT = "import torch.distributed as dist\ndist.init_process_group('nccl')\n"
DS_CONFIG = '{"train_micro_batch_size_per_gpu": 64, "optimizer": {"type": "Adam", "params": {"lr": 0.001}}}\n'

# What the page shows each of its commands printing, by the command as written (after `dptrain`).
SHOWN = {
    "train --epochs 2 --batch_size 64 --nproc_per_node 2": [
        # "Each is read as dptrain's own option, with one note on stderr that names it"
        "--epochs is read as --train.epochs", "--batch_size is read as --train.batch_size_per_rank",
        "--nproc_per_node is read as --nproc-per-node",
        # "printed as the run starts"
        "global batch 128 = train.batch_size_per_rank 64 x 2 ranks",
    ],
    "train --nnodes 2 --nproc_per_node 4 --rdzv_backend c10d --rdzv_endpoint node1:29400 --rdzv_id job42": [
        "--rdzv_backend c10d is the rendezvous dptrain's nodes always use",  # "taken with a note each"
        "--rdzv_id job42 is ignored",
        # "the rendezvous numbers the nodes"
        "8 ranks, 4 local workers on each of 2 nodes (numbered by the rendezvous)",
    ],
    "train --nnodes 1:4 --nproc_per_node 4 --rdzv_endpoint node1:29400 --launch.max_restarts 3 "
    "--train.global_batch_size 96": [
        "it goes on with 4 ranks on 1 nodes or more after losing nodes",  # "goes on after losing a node"
    ],
    "train --nproc-per-node 2 -- train.py --epochs 5": [
        # "as torchrun would start it, on a free port, with each rank's share of the cores"
        "on 2 local worker(s), world size 2, through dptrain's elastic agent (on a free port)", "OMP_NUM_THREADS=",
    ],
    "submit --nodes 2 --gres gpu:4 -- train.py --epochs 5 --batch_size 64": [
        # "one torchrun per node ..., rank 0 on the first node, and the script's arguments passed on as given"
        "--nnodes 2 --nproc-per-node 4 --node-rank \"$SLURM_NODEID\"", "train.py --epochs 5 --batch_size 64'",
        "#SBATCH --ntasks-per-node=1", "nccl on GPUs",  # --gres gpu:4 makes it a GPU job with nccl
    ],
}


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A fresh folder holding what the page's commands need, as the current directory; node1 is this host."""
    write_idx_dataset(tmp_path / "data" / "FashionMNIST" / "raw", TRAIN_SIZE, TEST_SIZE)
    (tmp_path / "train.py").write_text(TUTORIAL_SCRIPT)
    (tmp_path / "ds_config.json").write_text(DS_CONFIG)
    for name, text in PAGE_FILES.items():  # the files the page writes, as it shows them
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    real_getaddrinfo = socket.getaddrinfo

    def node1_is_here(host, *args, **kwargs):
        return real_getaddrinfo("127.0.0.1" if host == "node1" else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", node1_is_here)
    return tmp_path


def dptrain(argv: list[str], capsys, caplog) -> tuple[int, str]:
    """`dptrain ARGV` in this process: (its exit status, what it printed on stdout, stderr and through logging)."""
    caplog.clear()
    with caplog.at_level(logging.INFO):
        code = main(argv)
    out, err = capsys.readouterr()
    return code, out + err + caplog.text


def as_run(argv: list[str]) -> list[str]:
    """The page's command with --dry-run where it would start training or submit a job (before submit's --, whose
    words are the user's script's)."""
    if argv[0] not in ("train", "submit"):
        return argv
    at = argv.index("--") if "--" in argv else len(argv)
    return [*argv[:at], "--dry-run", *argv[at:]]


def test_the_page_has_its_commands():
    """An extraction that found next to nothing would pass the test below without running anything."""
    written = {" ".join(command.argv) for command in COMMANDS}
    assert set(SHOWN) <= written, f"the page no longer shows {sorted(set(SHOWN) - written)}; update SHOWN"
    assert len(COMMANDS) >= 8


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_each_command_on_the_page_runs_as_written(command: Command, folder, capsys, caplog):
    code, printed = dptrain(as_run(command.argv), capsys, caplog)
    assert code == 0, f"{command.where}: `dptrain {' '.join(command.argv)}` fails:\n{printed}"
    script = command.argv[command.argv.index("--") + 1:] if "--" in command.argv else None
    if command.argv[0] == "train" and script:  # a script of theirs: what would start it, and nothing started
        assert f"dptrain: would start {' '.join(script)} on " in printed
    elif command.argv[0] == "train":  # the data of this folder, not a copy somewhere on the machine
        assert "nothing was written" in printed
        assert f"{TRAIN_SIZE} training and {TEST_SIZE} test samples" in printed
    else:
        assert "nothing was written" in printed or command.argv[0] == "submit"
    for line in SHOWN.get(" ".join(command.argv), []):
        assert line in printed, f"{command.where}: the page shows {line!r}, the command printed:\n{printed}"
    assert sorted(p.name for p in folder.iterdir()) == sorted(["data", "train.py", "ds_config.json", *PAGE_FILES])


# Their flags: the table's left column, each with what dptrain prints for it (the right column).
NODE1 = ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "node1:29400"]  # node 0 of 2, on node1
FLAG_ROWS = {
    "--epochs": (["--epochs", "3"], "--epochs is read as --train.epochs"),
    "--num_epochs": (["--num_epochs", "3"], "--num_epochs is read as --train.epochs"),
    "--batch_size": (["--batch_size", "32"], "--batch_size is read as --train.batch_size_per_rank"),
    "--lr": (["--lr", "0.01"], "--lr is read as --optim.lr"),
    "--learning_rate": (["--learning_rate", "0.01"], "--learning_rate is read as --optim.lr"),
    "--seed": (["--seed", "3"], "--seed is read as --train.seed"),
    "--random_seed": (["--random_seed", "3"], "--random_seed is read as --train.seed"),
    "--model_dir": (["--model_dir", "saved"], "--model_dir is read as --output.weights_dir"),
    "--model_filename": (["--model_filename", "m.pt"], "--model_filename is read as --output.weights_file"),
    "--nproc_per_node": (["--nproc_per_node", "2"], "--nproc_per_node is read as --nproc-per-node"),
    "--node_rank": (["--nnodes", "2", "--node_rank", "0", "--master-addr", "node1"],
                    "--node_rank is read as --node-rank"),
    "--master_addr": (["--nnodes", "2", "--node-rank", "0", "--master_addr", "node1"],
                      "--master_addr is read as --master-addr"),
    "--master_port": (["--nnodes", "2", "--node-rank", "0", "--master-addr", "node1", "--master_port", "29400"],
                      "--master_port is read as --master-port"),
    "--rdzv_endpoint": (["--nnodes", "2", "--node-rank", "0", "--rdzv_endpoint", "node1:29400"],
                        "--rdzv_endpoint is read as --rdzv-endpoint"),
    "--rdzv_backend": ([*NODE1, "--rdzv_backend", "c10d"],
                       "--rdzv_backend c10d is the rendezvous dptrain's nodes always use"),
    "--rdzv-backend": ([*NODE1, "--rdzv-backend", "c10d"],
                       "--rdzv-backend c10d is the rendezvous dptrain's nodes always use"),
    "--rdzv_id": ([*NODE1, "--rdzv_id", "job42"],
                  "--rdzv_id job42 is ignored"),
    "--rdzv-id": ([*NODE1, "--rdzv-id", "job42"],
                  "--rdzv-id job42 is ignored"),
    "--deepspeed": (["--deepspeed", "--deepspeed_config", "ds_config.json", "--train.global_batch_size", "64"],
                    "--deepspeed is read as --strategy.name deepspeed"),
    "--deepspeed_config": (["--deepspeed", "--deepspeed_config", "ds_config.json", "--train.global_batch_size", "64"],
                           "--deepspeed_config is read as --strategy.deepspeed.config"),
    "--local_rank": (["--local_rank", "0"], "strategy ddp"),  # ignored: the run is the one without it
}


def flag_table_rows() -> list[tuple[str, str]]:
    """(left cell, right cell) of the page's first table, "Their flags"."""
    text = PAGE.read_text(encoding="utf-8").split("### Their flags", 1)[1].split("###", 1)[0]
    rows = [line.strip().strip("|").split(" | ") for line in text.splitlines() if line.startswith("| `")]
    return [(left.strip(), right.strip()) for left, right in rows]


def test_every_flag_of_the_table_is_checked():
    """A row added to the table without a check below fails here."""
    left_flags = {flag for left, _ in flag_table_rows() for flag in re.findall(r"`(--[\w-]+)", left)}
    unchecked = left_flags - set(FLAG_ROWS) - {"--gpus-per-task", "--gpus"}
    assert not unchecked, f"the table's flags {sorted(unchecked)} have no check in FLAG_ROWS"
    assert len(left_flags) >= 20


@pytest.mark.parametrize("flag", FLAG_ROWS)
def test_each_tutorial_flag_is_read_as_the_table_says(flag, folder, capsys, caplog):
    words, shown = FLAG_ROWS[flag]
    code, printed = dptrain(["train", "--dry-run", *words], capsys, caplog)
    assert code == 0, printed
    assert shown in printed


def test_their_model_dir_and_filename_are_where_the_final_weights_go(folder, capsys, caplog):
    """`--model_dir DIR --model_filename NAME`: the final weights go to DIR/NAME; the run's folder stays runs/<name>."""
    code, printed = dptrain(["train", "--dry-run", "--model_dir", "saved", "--model_filename", "m.pt"], capsys, caplog)
    assert code == 0 and "writes     runs/fashion-mnist_mnist-cnn_ddp (" in printed, printed
    assert "the final weights to saved/m.pt" in printed


def test_an_unknown_option_is_answered_with_the_closest_name(folder, capsys, caplog):
    code, printed = dptrain(["train", "--dry-run", "--train.epoch", "3"], capsys, caplog)
    assert code == 2 and "unknown option --train.epoch; did you mean --train.epochs?" in printed


def test_another_rendezvous_backend_is_refused(folder, capsys, caplog):
    code, printed = dptrain(["train", "--dry-run", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
                             "node1:29400", "--rdzv_backend", "etcd"], capsys, caplog)
    assert code == 2 and "--rdzv_backend etcd is not a rendezvous dptrain has" in printed


def test_their_gpus_on_train_is_refused_with_its_meaning(folder, capsys, caplog):
    """The refusal names the options the table's row gives as its meaning here."""
    code, printed = dptrain(["train", "--dry-run", "--gpus", "4"], capsys, caplog)
    assert code == 2 and "give --nproc-per-node N here, or --gpus-per-node N to dptrain submit" in printed
    row = next(right for left, right in flag_table_rows() if left.startswith("`--gpus 4`"))
    meanings = re.findall(r"`(--[^`]+)`", row)
    assert len(meanings) == 2 and all(meaning in printed for meaning in meanings), (meanings, printed)


def test_their_gpus_per_task_row_is_the_command_that_works(folder, capsys, caplog):
    """The table's row for --gpus-per-task, as written, is a job dptrain writes."""
    row = next(right for left, right in flag_table_rows() if left.startswith("`--gpus-per-task 1`"))
    words = ["4" if word == "N" else word for word in " ".join(re.findall(r"`(--[^`]+)`", row)).split()]
    code, printed = dptrain(["submit", "--dry-run", *words], capsys, caplog)
    assert code == 0 and "#SBATCH --gpus-per-task=1" in printed, printed


def test_their_gpus_per_task_on_submit_is_an_sbatch_line_of_a_gpu_job(folder, capsys, caplog):
    code, printed = dptrain(["submit", "--dry-run", "--gpus-per-task", "1", "--ranks-per-node", "4"], capsys, caplog)
    assert code == 0, printed
    assert "--gpus-per-task 1 is read as --sbatch gpus-per-task=1" in printed
    assert "#SBATCH --gpus-per-task=1" in printed and "nccl on GPUs" in printed


@pytest.mark.parametrize("gpus", [["--gres", "gpu:4"], ["--gpus", "8"]])
def test_their_gpu_requests_make_a_gpu_job_with_nccl(gpus, folder, capsys, caplog):
    code, printed = dptrain(["submit", "--dry-run", *gpus], capsys, caplog)
    assert code == 0 and "nccl on GPUs" in printed and f"#SBATCH {gpus[0]}={gpus[1]}" in printed


def test_an_sbatch_line_repeating_dptrains_own_option_is_refused_naming_the_option(folder, capsys, caplog):
    code, printed = dptrain(["submit", "--dry-run", "--sbatch", "ntasks-per-node=4"], capsys, caplog)
    assert code == 2 and "which dptrain writes itself; give --ranks-per-node" in printed


def test_a_batch_per_rank_and_a_global_batch_must_agree(folder, capsys, caplog):
    """"Given both, they must agree.\""""
    code, printed = dptrain(["train", "--dry-run", "--nproc-per-node", "2", "--batch_size", "64",
                             "--train.global_batch_size", "100"], capsys, caplog)
    assert code == 2, printed
    code, printed = dptrain(["train", "--dry-run", "--nproc-per-node", "2", "--batch_size", "64",
                             "--train.global_batch_size", "128"], capsys, caplog)
    assert code == 0, printed


def test_a_submitted_job_keeps_the_batch_per_rank_and_prints_its_log(folder, capsys, caplog, monkeypatch,
                                                                    slurm_cluster):
    """`job.toml` holds the batch per rank (so `sbatch --nodes=2` trains 2 nodes' worth), the job's log is
    `runs/<name>/logs/slurm-<jobid>.out`, and `--output` moves it to the file the `tail -f` line names. Submitted to
    the private SLURM cluster, held (`--sbatch hold`: the test is about what submit writes and says, not the run),
    then cancelled."""
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    held = ["--sbatch", "hold"]
    code, printed = dptrain(["submit", "--output.name", "plain", *held], capsys, caplog)
    assert code == 0, printed
    first = re.search(r"submitted job (\d+) ", printed)
    assert first is not None and f"tail -f {folder / 'runs' / 'plain' / 'logs' / f'slurm-{first[1]}.out'}" in printed
    code, printed = dptrain(["submit", "--batch_size", "64", "--output", "logs/ddp_%j.out", *held], capsys, caplog)
    second = re.search(r"submitted job (\d+) ", printed)
    assert code == 0 and second is not None, printed
    for job_id in (first[1], second[1]):
        assert slurm_cluster.job(int(job_id))["JobState"] == "PENDING"
        assert slurm_cluster.run("scancel", job_id).returncode == 0
    named = config_mod.experiment_name(config_mod.load(None, [("train.batch_size_per_rank", "64")]))
    job = config_mod.load(folder / "runs" / named / "job.toml")
    assert job.train.batch_size_per_rank == 64
    # each rank resolves it at the world size it finds: 2 nodes of 1 rank after `sbatch --nodes=2`
    assert resolve_batch(job, 2).train.global_batch_size == 128
    assert f"tail -f {folder / 'logs' / f'ddp_{second[1]}.out'}" in printed
    assert "#SBATCH --output=" in (folder / "runs" / named / "job.sbatch").read_text()


LAUNCHERS = {  # the variables each launcher gives the process it starts: rank 0 of 4
    "torchrun --nproc-per-node 4 -m dptrain train": {
        "RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500"},
    "srun .venv/bin/python -m dptrain train": {
        "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_STEP_ID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_ID": "5"},
}


@pytest.mark.parametrize("line", LAUNCHERS)
def test_dptrain_train_under_their_launcher_takes_its_ranks(line, folder, capsys, caplog, monkeypatch):
    """`torchrun --nproc-per-node 4 -m dptrain train` under a torchrun of theirs, `srun .venv/bin/python -m dptrain
    train` for `srun python train.py`: the page's lines; each process is a rank of the launcher's 4."""
    assert f"`{line}`" in PAGE.read_text(encoding="utf-8")
    for name, value in LAUNCHERS[line].items():
        monkeypatch.setenv(name, value)
    code, printed = dptrain(["train", "--dry-run"], capsys, caplog)
    assert code == 0 and "4 ranks of the launcher that started this process" in printed, printed


@pytest.mark.slow
def test_their_files_and_output_from_one_tiny_run(folder, capsys, caplog):
    """The table "Their files and their output", from one process training 2 steps of synthetic data with the
    tutorials' --batch_size, --model_dir and --model_filename, then the same command again: where each file goes, the
    epoch and [METRIC] lines, the resume by running the same command (and the refusal at another world size), and
    `dptrain checkpoint export SNAPSHOT model.pt`."""
    command = ["train", "--data.name", "synthetic", "--data.synthetic_train_size", "64", "--data.synthetic_test_size",
               "32", "--train.epochs", "1", "--batch_size", "32", "--model_dir", "saved",
               "--model_filename", "m.pt"]
    code, printed = dptrain(command, capsys, caplog)
    assert code == 0, printed
    run = folder / "runs" / config_mod.experiment_name(config_mod.load(None, [
        ("data.name", "synthetic"), ("data.synthetic_train_size", "64"), ("data.synthetic_test_size", "32"),
        ("train.batch_size_per_rank", "32")]))  # named after the experiment: the same command finds it again
    # Their batch size: printed as the run starts, saved as train.global_batch_size in the run's config.toml
    assert "global batch 32 = train.batch_size_per_rank 32 x 1 ranks" in printed
    assert "global_batch_size = 32\n" in (run / "config.toml").read_text()
    assert re.search(r"Epoch 1/1 \| train loss [\d.]+ \| acc [\d.]+% \| .* s \|", printed), printed
    assert "[METRIC] epoch=1 step=2 train_loss=" in printed
    assert (run / "metrics.jsonl").read_text().strip()
    assert "rank 0 epoch 1: 2 steps, 64 samples" in (run / "logs" / "rank0.log").read_text()  # each rank's own line
    assert any(b"epoch lines" in events.read_bytes() for events in (run / "tb").iterdir())  # TensorBoard's TEXT tab
    snapshot = run / "checkpoints" / "step-00000002"
    assert snapshot.is_dir()
    # `model.pt` at the end: DIR/NAME with --model_dir DIR --model_filename NAME, the run's folder left for the rest
    assert (folder / "saved" / "m.pt").is_file() and not (run / "model.pt").exists()

    code, printed = dptrain(command, capsys, caplog)  # "resumed by running the same command"
    assert code == 0 and f"resumed from {snapshot.relative_to(folder)} at step 2" in printed, printed

    # "a resume at another world size is refused" (the dry run says so on its resume line)
    code, printed = dptrain([*command, "--train.epochs", "2", "--nproc-per-node", "2", "--dry-run"], capsys, caplog)
    assert code == 0 and "refused, so the run would stop before its first step: snapshot" in printed, printed
    assert "was written with train.global_batch_size = 32 but this run has 64" in printed, printed

    code, printed = dptrain(["checkpoint", "export", str(snapshot.relative_to(folder)), "model.pt"], capsys, caplog)
    assert code == 0, printed
    weights = torch.load(folder / "model.pt", weights_only=True)  # "the one plain file"
    assert weights.keys() == torch.load(folder / "saved" / "m.pt", weights_only=True).keys()


SBATCH_NAMES = [  # "It takes their #SBATCH options under their own names", each written into the job's script
    (["--nodes", "2"], "#SBATCH --nodes=2"), (["--ntasks-per-node", "2"], "#SBATCH --ntasks-per-node=2"),
    (["--cpus-per-task", "3"], "#SBATCH --cpus-per-task=3"), (["--gpus-per-node", "1"], "#SBATCH --gpus-per-node=1"),
    (["--gpus", "8"], "#SBATCH --gpus=8"), (["--gres", "gpu:4"], "#SBATCH --gres=gpu:4"),
    (["--job-name", "mnist"], "#SBATCH --job-name=mnist"), (["--output", "logs/o_%j.out"], "logs/o_%j.out\n"),
    (["--error", "logs/e_%j.err"], "logs/e_%j.err\n"), (["--nodelist", "node1"], "#SBATCH --nodelist=node1"),
    (["-w", "node1"], "#SBATCH --nodelist=node1"), (["--exclude", "node9"], "#SBATCH --exclude=node9"),
    (["--mail-type", "END"], "#SBATCH --mail-type=END"), (["--mail-user", "a@b.c"], "#SBATCH --mail-user=a@b.c"),
]


def test_the_sbatch_options_the_page_lists_are_the_ones_checked():
    listed = PAGE.read_text(encoding="utf-8").split("under\ntheir own names:", 1)[1].split("; each sets", 1)[0]
    assert set(re.findall(r"`(-[-\w]+)`", listed)) == {words[0] for words, _ in SBATCH_NAMES}


@pytest.mark.parametrize("words, line", SBATCH_NAMES, ids=[" ".join(words) for words, _ in SBATCH_NAMES])
def test_submit_takes_each_sbatch_option_under_its_own_name(words, line, folder, capsys, caplog):
    code, printed = dptrain(["submit", "--dry-run", *words], capsys, caplog)
    assert code == 0 and line in printed, printed


def test_their_script_run_by_python_after_the_double_dash(folder, capsys, caplog):
    """"(or `-- python train.py ...`)": the same torchrun per node, the script's arguments as given."""
    code, printed = dptrain(["submit", "--dry-run", "--nodes", "2", "--gres", "gpu:4", "--", "python", "train.py",
                             "--epochs", "5", "--batch_size", "64"], capsys, caplog)
    assert code == 0, printed
    assert ("--nnodes 2 --nproc-per-node 4 --node-rank \"$SLURM_NODEID\"" in printed
            and "train.py --epochs 5 --batch_size 64'" in printed)


def test_their_data_folder_is_found_as_it_is(folder, capsys, caplog):
    """`Data/` of torchvision's download, read with --data.root ./Data."""
    write_idx_dataset(folder / "Data" / "FashionMNIST" / "raw", 300, 50, gz=False)
    code, printed = dptrain(["train", "--dry-run", "--data.root", "./Data"], capsys, caplog)
    assert code == 0 and "fashion-mnist: 300 training and 50 test samples" in printed, printed
