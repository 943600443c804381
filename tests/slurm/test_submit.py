"""`dptrain submit`: the job scripts as text (golden files for the seeds' GPU and CPU clusters), the options'
checks, and the CLI around them. Jobs on a real scheduler are in test_slurm_jobs.py.

To rewrite the golden files after an intended change: DPTRAIN_REGOLD=1 pytest tests/slurm/test_submit.py (each
golden test then fails, saying it rewrote its file and compared nothing), read the diff, then run it again without.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from dptrain import config as config_mod
from dptrain.distributed.env import DistEnv
from dptrain.errors import ConfigError
from dptrain.runtime import set_cpu_threads
from dptrain.slurm import job as slurm_job, partition as slurm_partition, script as slurm_script
from tests.conftest import assert_matches_golden

pytestmark = pytest.mark.usefixtures("no_slurm_clients")  # their submits are dry runs: no SLURM on PATH (conftest)

GOLDEN = Path(__file__).parent / "golden"
WORKDIR = Path("/home/ada/project")  # where the user ran `dptrain submit`, as the script's --chdir
PYTHON = "/home/ada/project/.venv/bin/python"
DATA = ["--data.name", "synthetic"]  # preflight reads the dataset: the synthetic one needs no files

# name -> `dptrain submit` options (the seeds' clusters)
CASES = {
    "gpu-1node-4gpus": ["--gpus-per-node", "4", "--time", "00:20:00", "--partition", "gpu"],
    "gpu-2nodes-4gpus": ["--nodes", "2", "--gpus-per-node", "4", "--cpus-per-node", "32", "--time", "02:00:00",
                         "--partition", "gpu", "--account", "proj123", "--strategy.name", "fsdp"],
    "gpu-2nodes-4gpus-agent": ["--nodes", "2", "--gpus-per-node", "4", "--mode", "agent", "--time", "02:00:00",
                               "--partition", "gpu", "--setup", "module load pytorch/2.6", "--requeue",
                               "--launch.max_restarts", "2"],
    "cpu-4nodes": ["--nodes", "4", "--cpus-per-node", "16", "--ranks-per-node", "2", "--partition", "small",
                   "--time", "1-00:00:00", "--mem", "900M", "--sbatch", "mail-type=END"],
}


@pytest.fixture
def submit(tmp_path, monkeypatch, capsys):
    """`dptrain submit ARGS` in this process, from tmp_path: (exit code, stdout, stderr). A subprocess would
    cost a Python and torch start per call, and these calls start no rank."""
    from dptrain.cli import main

    monkeypatch.chdir(tmp_path)

    def call(*args: str) -> tuple[int, str, str]:
        code = main(["submit", *args])
        out, err = capsys.readouterr()
        return code, out, err

    return call


def rendered(options: list[str]) -> str:
    """The script `dptrain submit OPTIONS` writes, as from WORKDIR with PYTHON."""
    from dptrain.cli import build_parser, split_overrides, submit_overrides

    from dptrain.prestart import named_after_its_experiment

    args, extra = build_parser().parse_known_args(["submit", *options])
    pairs = [*split_overrides(extra), *submit_overrides(args)]
    cfg = named_after_its_experiment(config_mod.load(None, pairs), {key for key, _ in pairs})  # as submit names it
    if args.setup or args.sbatch:
        import dataclasses

        cfg = dataclasses.replace(cfg, slurm=dataclasses.replace(cfg.slurm, setup=tuple(args.setup), sbatch=tuple(args.sbatch)))
    script = slurm_script.render(cfg, slurm_job.job_for(cfg, WORKDIR))
    return script.replace(sys.executable, PYTHON)


@pytest.mark.parametrize("name", CASES)
def test_job_scripts_match_the_golden_files(name):
    assert_matches_golden(rendered(CASES[name]), GOLDEN / f"{name}.sbatch")


def test_the_cli_writes_what_its_dry_run_prints_and_the_dry_run_writes_nothing(submit, tmp_path, monkeypatch):
    options = CASES["cpu-4nodes"]
    code, dry, err = submit("--dry-run", *options, *DATA)
    assert code == 0, err
    assert not (tmp_path / "runs").exists()  # nothing written
    expected = (GOLDEN / "cpu-4nodes.sbatch").read_text().replace(PYTHON, sys.executable).replace(str(WORKDIR), str(tmp_path))
    expected = expected.replace("runs/fashion-mnist_", "runs/synthetic_").replace("dptrain-fashion-mnist_",
                                                                                 "dptrain-synthetic_")  # DATA's run
    assert dry == expected
    # Without sbatch on PATH the script and its config are kept, and one sentence says what to do.
    run_dir = tmp_path / "runs" / "synthetic_mnist-cnn_ddp"
    monkeypatch.setenv("PATH", "/nonexistent")
    code, _, err = submit(*options, *DATA)
    assert code == 1
    assert err.strip().splitlines() == [f"dptrain: error: sbatch is not on PATH here; run dptrain submit on a "
                                                f"SLURM login node, or submit {run_dir / 'job.sbatch'} with sbatch "
                                                f"yourself."]
    assert (run_dir / "job.sbatch").read_text() == dry
    job_cfg = config_mod.load(run_dir / "job.toml")
    assert (job_cfg.slurm.nodes, job_cfg.slurm.cpus_per_node, job_cfg.slurm.ranks_here) == (4, 16, 2)
    assert job_cfg.data.name == "synthetic"


def test_the_slurm_table_of_the_config_file_is_read_and_the_command_line_wins(submit, tmp_path):
    (tmp_path / "run.toml").write_text('[slurm]\nnodes = 4\npartition = "long"\nsetup = ["module load a", "module load b"]\n')
    _, out, _ = submit("--dry-run", "--config", "run.toml", "--partition", "short", *DATA)
    assert "#SBATCH --nodes=4\n" in out and "#SBATCH --partition=short\n" in out
    assert "\nmodule load a\nmodule load b\n" in out
    _, out, _ = submit("--dry-run", "--config", "run.toml", "--setup", "source ~/venv/bin/activate", *DATA)
    assert "module load" not in out and "\nsource ~/venv/bin/activate\n" in out
    assert " python -m dptrain train " in out  # set-up lines provide the interpreter


@pytest.mark.parametrize("options, sentence", [
    (["--time", "2h"], "slurm.time = '2h' is not a time sbatch reads; write it as HH:MM:SS or D-HH:MM:SS."),
    (["--requeue", "--signal-lead-s", "0"], "slurm.requeue needs slurm.signal_lead_s above 0"),
    (["--cpus-per-node", "2", "--ranks-per-node", "4"], "slurm.ranks_per_node = 4 is more than slurm.cpus_per_node = 2"),
    (["--nodes", "0"], "slurm.nodes = 0 must be greater than 0."),
    (["--launch.device", "cuda"], "launch.device = cuda but the job asks for no GPUs"),
    (["--slurm.setup", "a\nb"], "slurm.setup holds a line break"),
])
def test_bad_job_options_are_refused_in_one_sentence_before_anything_is_written(submit, tmp_path, options, sentence):
    code, _, err = submit(*options, *DATA)
    assert code == 2
    [line] = err.strip().splitlines()
    assert line.startswith("dptrain: error: ") and sentence in line
    assert not (tmp_path / "runs").exists()


def test_a_run_directory_that_sbatch_lines_cannot_carry_is_refused(submit, tmp_path):
    code, _, err = submit("--output.dir", "runs/my run", *DATA)
    assert code == 2 and "holds a space, quote or other character that #SBATCH lines cannot carry" in err, err
    assert not (tmp_path / "runs").exists()


def test_a_world_the_data_cannot_feed_is_refused_for_the_job_world_size(submit):
    # 8 nodes x 2 ranks = 16 ranks for a global batch of 8: the same check as dptrain train's, for the job's world.
    code, _, err = submit("--nodes", "8", "--ranks-per-node", "2", "--train.global_batch_size", "8", *DATA)
    assert code == 2 and "world size 16" in err, err


@pytest.mark.parametrize("source, task_cpus, local_ranks, cores, expected", [
    ("slurm", "6", 4, 64, 6),     # one srun task per rank: the task's cores, even where the CPU set shows the node
    ("torchrun", "8", 4, 64, 2),  # an agent's task: its cores shared among the node's ranks
    ("slurm", None, 4, 64, 16),   # no --cpus-per-task: the CPU set, shared among the node's ranks
    ("slurm", "8", 1, 2, 2),      # never more threads than cores in the CPU set
])
def test_threads_per_rank_follow_the_cores_slurm_gives_the_task(monkeypatch, source, task_cpus, local_ranks, cores, expected):
    import torch

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    if task_cpus is None:
        monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    else:
        monkeypatch.setenv("SLURM_CPUS_PER_TASK", task_cpus)
    before = torch.get_num_threads()
    try:
        env = DistEnv(0, 0, 8, local_ranks, "127.0.0.1", 0, source)
        assert set_cpu_threads(env) == expected
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)


def test_the_port_in_the_script_is_the_one_ranks_derive_from_the_job_id(tmp_path):
    """Two jobs on one node get different ports; the script and DistEnv (srun without MASTER_PORT) agree."""
    import subprocess

    line = next(l for l in rendered([]).splitlines() if l.startswith("export MASTER_PORT="))
    ports = set()
    for job_id in ("1234", "1235"):
        shell = subprocess.run(["bash", "-c", f"{line}; echo $MASTER_PORT"], env={"SLURM_JOB_ID": job_id},
                               capture_output=True, text=True, check=True).stdout.strip()
        env = DistEnv.from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
                                    "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": job_id})
        assert int(shell) == env.master_port
        ports.add(env.master_port)
    assert len(ports) == 2


def test_setup_lines_cannot_smuggle_a_line_break_through_the_config_file(tmp_path):
    (tmp_path / "bad.toml").write_text('[slurm]\nsbatch = ["--mail-type=END\\nrm -rf ~"]\n')
    with pytest.raises(ConfigError, match="slurm.sbatch holds a line break"):
        config_mod.load(tmp_path / "bad.toml")


ONE_OPTION_MORE = "debug --job-name=X --comment=y"  # '#SBATCH --partition=debug --job-name=X --comment=y' ran as X


@pytest.mark.parametrize("option", ["--partition", "--account", "--qos", "--constraint", "--mem"])
@pytest.mark.parametrize("value, reading", [
    (ONE_OPTION_MORE, "reads as more than one option"),
    ("debug\tx", "reads as more than one option"),
    ("debug\n#SBATCH --job-name=X", "reads as more than one line or option"),
    ("a\x1b[2J", "reads as more than one line or option"),
    ("debug#x", "reads otherwise than written"),   # sbatch drops what follows a #: the job asked for 'debug'
    ('"debug --job-name=X"', "reads otherwise than written"),
])
def test_a_one_word_job_option_that_sbatch_would_read_otherwise_is_refused(submit, tmp_path, option, value, reading):
    code, _, err = submit(option, value, *DATA)
    assert code == 2
    [line] = err.strip().splitlines()
    name = option.removeprefix("--").replace("-", "_")
    written = f"#SBATCH {option}={value}"
    assert line.startswith(f"dptrain: error: slurm.{name} = {value!r} would be written as {written!r}, which sbatch "
                           f"{reading}")
    assert line.endswith("; give one word, as sbatch takes it, without spaces, quotes, backslashes or # (other sbatch "
                         "options go in slurm.sbatch).")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("option, value", [("--time", ONE_OPTION_MORE), ("--master-addr", ONE_OPTION_MORE),
                                           ("--master-addr", "a\x1b[2J")])
def test_the_time_and_the_master_address_are_checked_with_the_config(submit, tmp_path, option, value):
    code, _, err = submit(option, value, *DATA)
    assert code == 2
    [line] = err.strip().splitlines()
    assert line == {"--time": f"dptrain: error: slurm.time = {value!r} is not a time sbatch reads; write it as HH:MM:SS or "
                              f"D-HH:MM:SS.",
                    "--master-addr": f"dptrain: error: slurm.master_addr = {value!r} holds a space or control character; "
                                     f"give one host name or address."}[option]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
@pytest.mark.parametrize("options, line", [
    (["--sbatch", "comment=x --job-name=INJECTED"], "comment=x --job-name=INJECTED"),  # the job ran as INJECTED
    (["--sbatch", "mail-type=END", "--sbatch", "-G 4 -J INJECTED"], "-G 4 -J INJECTED"),
    (["--sbatch", "comment=x\t--job-name=INJECTED"], "comment=x\t--job-name=INJECTED"),
    (["--sbatch", 'comment="x --job-name=INJECTED"'], 'comment="x --job-name=INJECTED"'),  # quotes: sbatch's own syntax
    (["--sbatch", "comment=x#y"], "comment=x#y"),
])
def test_an_sbatch_line_that_would_smuggle_another_option_is_refused_before_anything_is_written(submit, tmp_path,
                                                                                                 dry_run, options, line):
    code, out, err = submit(*dry_run, *options, *DATA)
    assert code == 2 and out == ""
    sentence = err.strip().splitlines()[-1]  # --gres is first noted as --sbatch gres=..., its name here
    written = "#SBATCH " + (line if line.startswith("-") else "--" + line)
    assert sentence.startswith(f"dptrain: error: slurm.sbatch's line {line!r} would be written as {written!r}, which "
                               f"sbatch reads ")
    assert sentence.endswith("; give each option its own --sbatch line, as --sbatch NAME=VALUE with no space, quote, "
                             "backslash or # in VALUE.")
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("option", ["--job-name", "--mail-user", "--nodelist", "-w", "--gres", "--exclude"])
@pytest.mark.parametrize("value, reading", [("a b --chdir=/", "reads as more than one option"),
                                            ("a#b", "reads otherwise than written (quotes and backslashes are its own "
                                                    "syntax there, and # starts a comment)")])
def test_an_sbatch_name_sbatch_would_read_otherwise_is_refused_naming_that_option(submit, tmp_path, option, value,
                                                                                   reading):
    """--job-name's refusal advised about --output.dir; --mail-user's and --nodelist's named slurm.sbatch, which was
    not given."""
    code, out, err = submit("--dry-run", option, value, *DATA)
    name = {"-w": "--nodelist"}.get(option, option)
    source = "the job's name (--job-name)" if name == "--job-name" else f"{name} {value!r}"
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [f"dptrain: error: {source} would be written as '#SBATCH {name}={value}', which "
                                        f"sbatch {reading}; give {name} one word, without spaces, quotes, backslashes "
                                        f"or #."]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("options, says", [
    (["--output", "/etc"], "--output '/etc' names a folder; give the file SLURM writes to, e.g. /etc/slurm-%j.log."),
    (["--sbatch", "chdir=/"], "slurm.sbatch's line 'chdir=/' sets sbatch's --chdir, which dptrain writes itself; run "
                              "dptrain submit from the folder the job is to run in instead."),
    (["--output", "logs/a#b.out"], "the job's output file (--output) would be written as '#SBATCH --output={tmp}/logs/"
                                   "a#b.out', which sbatch reads otherwise than written (quotes and backslashes are its "
                                   "own syntax there, and # starts a comment); give --output a plain path, without "
                                   "spaces, quotes, backslashes or #."),
])
def test_a_refused_job_file_or_folder_is_an_option_error(submit, tmp_path, options, says):
    for dry_run in ([], ["--dry-run"]):
        code, out, err = submit(*dry_run, *options, *DATA)
        assert code == 2 and out == ""
        assert err.strip().splitlines() == ["dptrain: error: " + says.format(tmp=tmp_path)]
    assert not (tmp_path / "runs").exists()


def test_an_option_and_its_value_as_two_words_are_one_sbatch_line(submit):
    # sbatch reads '#SBATCH --mail-type END' and '#SBATCH -G 4' as one option each (tests/slurm/test_job.py asks sbatch)
    code, out, err = submit("--dry-run", "--sbatch", "mail-type END", "--sbatch", "-G 4", "--ranks-per-node", "4", *DATA)
    assert code == 0, err
    assert "\n#SBATCH --mail-type END\n#SBATCH -G 4\n" in out


@pytest.mark.parametrize("option", ["--setup", "--sbatch", "--python"])
def test_a_control_character_in_a_job_line_is_refused(submit, tmp_path, option):
    code, _, err = submit(option, "echo \x1b[2J\x1b[Hforged", *DATA)
    assert code == 2
    assert err.strip().splitlines() == [f"dptrain: error: slurm.{option[2:]} holds a line break or another control character; "
                                        f"give printable text, one line per list item."]
    # a tab is a shell line's own
    code, out, err = submit("--dry-run", option, "echo\ta", *DATA)
    assert code == 0 and "echo\ta" in out, err


SINFO = """\
gpu01|gpu|64|gpu:a100:4(S:0-1)
gpu02|gpu|64|gpu:a100:2(S:0),gpu:v100:2(S:1),nvme:1
cpu01|small*|16|(null)
cpu02|small*|16|(null)
cpu01|all|16|(null)
big01|all|128|(null)
sinfo: error: a line that is no node
"""


@pytest.mark.parametrize("partition, nodes", [
    (None, [slurm_partition.Node("cpu01", 16, 0), slurm_partition.Node("cpu02", 16, 0)]),  # the default partition, marked *
    ("gpu", [slurm_partition.Node("gpu01", 64, 4), slurm_partition.Node("gpu02", 64, 4)]),
    ("all", [slurm_partition.Node("cpu01", 16, 0), slurm_partition.Node("big01", 128, 0)]),
    ("small,all", [slurm_partition.Node("cpu01", 16, 0), slurm_partition.Node("cpu02", 16, 0), slurm_partition.Node("big01", 128, 0)]),
    ("nosuch", []),
])
def test_sinfo_nodes_are_read_per_partition(partition, nodes):
    assert slurm_partition.partition_nodes(SINFO, partition) == nodes


@pytest.mark.parametrize("options, request_", [
    ([], (1, 0)),
    (["--ranks-per-node", "64"], (64, 0)),
    (["--ranks-per-node", "4", "--cpus-per-node", "18"], (16, 0)),  # 4 tasks x --cpus-per-task 4
    (["--gpus-per-node", "4", "--cpus-per-node", "32"], (32, 4)),
    (["--ranks-per-node", "64", "--mode", "agent"], (1, 0)),  # one agent task per node
])
def test_the_cpus_and_gpus_one_node_must_have_are_those_the_script_asks_for(options, request_):
    from dptrain.cli import build_parser, submit_overrides

    args, _ = build_parser().parse_known_args(["submit", *options])
    assert slurm_partition.per_node_request(config_mod.load(None, submit_overrides(args)).slurm) == request_


def test_without_sinfo_the_partition_is_not_checked(slurm_cluster, monkeypatch):
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    too_wide = config_mod.load(None, [("slurm.ranks_per_node", "100000")]).slurm
    with pytest.raises(ConfigError, match="would wait in the queue for ever"):  # the cluster's sinfo says so
        slurm_partition.check_nodes_fit(too_wide)
    monkeypatch.setenv("PATH", "/nonexistent")  # no sinfo here (a login node without SLURM's clients): no check
    slurm_partition.check_nodes_fit(too_wide)


def test_a_sinfo_that_does_not_answer_in_time_leaves_the_check_to_sbatch(tmp_path, monkeypatch):
    """A login node whose sinfo retries a controller that does not answer (9-60 s): after SINFO_TIMEOUT_S nothing
    is checked, and the submission goes on."""
    (tmp_path / "sinfo").write_text("#!/bin/sh\nexec sleep 30\n")
    (tmp_path / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(slurm_partition, "SINFO_TIMEOUT_S", 0.3)
    too_wide = config_mod.load(None, [("slurm.ranks_per_node", "100000")]).slurm
    started = time.monotonic()
    slurm_partition.check_nodes_fit(too_wide)  # no verdict: sbatch decides
    assert time.monotonic() - started < 10  # the 30 s it would sleep


def test_a_gres_line_makes_the_job_a_gpu_job(submit, tmp_path):
    # `--sbatch gres=gpu:4` was a CPU job: 1 rank, "gloo on CPUs", and --launch.device cuda refused for "no GPUs".
    code, out, err = submit("--dry-run", "--sbatch", "gres=gpu:4", "--launch.device", "cuda", *DATA)
    assert code == 0, err
    assert "1 node x 4 ranks (one srun task per rank, nccl on GPUs)" in out
    assert "#SBATCH --ntasks-per-node=4\n" in out and "#SBATCH --gres=gpu:4\n" in out
    assert "--gpus-per-node" not in out  # the user's line asks for them; twice would be two requests
    # the config file's slurm.sbatch as well; --gpus=8 is a total over the job's 2 nodes
    (tmp_path / "run.toml").write_text('[slurm]\nnodes = 2\nsbatch = ["--gpus=8"]\n')
    code, out, err = submit("--dry-run", "--config", "run.toml", *DATA)
    assert code == 0, err
    assert "2 nodes x 4 ranks (one srun task per rank, nccl on GPUs)" in out and "#SBATCH --gpus=8\n" in out


def test_gpus_asked_for_twice_with_different_counts_are_refused_in_one_sentence(submit, tmp_path):
    code, _, err = submit("--gpus-per-node", "2", "--sbatch", "gres=gpu:4", *DATA)
    assert code == 2
    assert err.strip().splitlines() == ["dptrain: error: slurm.gpus_per_node = 2 but slurm.sbatch's --gres=gpu:4 asks "
                                        "for 4 per node; ask for the GPUs once, as --gpus-per-node N or as an --sbatch line."]
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------- sbatch's options under their own names

def sbatch_lines_of(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_sbatch_names_set_the_job_options_of_their_meaning(submit):
    code, named, err = submit("--dry-run", "--nodes", "2", "--ntasks-per-node", "2", "--cpus-per-task", "3", *DATA)
    assert code == 0, err
    code, dptrains, err = submit("--dry-run", "--nodes", "2", "--ranks-per-node", "2", "--cpus-per-node", "6", *DATA)
    assert code == 0, err
    assert named == dptrains  # the same job, asked for in either's words
    assert {"--ntasks-per-node=2", "--cpus-per-task=3"} <= set(sbatch_lines_of(named))
    assert "2 nodes x 2 ranks" in named
    code, _, err = submit("--dry-run", "--ntasks-per-node", "2", "--ranks-per-node", "4", *DATA)
    assert code == 2 and err.strip().splitlines() == [
        "dptrain: error: --ntasks-per-node and --ranks-per-node are two ways to set slurm.ranks_per_node; give one of "
        "them."]


def test_cpus_per_task_is_per_rank_where_gres_decides_the_ranks(submit):
    """--gres gpu:4 makes 4 ranks a node, each the srun task --cpus-per-task 8 speaks of: 8 cores each, not 8 shared."""
    code, out, err = submit("--dry-run", "--gres", "gpu:4", "--cpus-per-task", "8", *DATA)
    assert code == 0, err
    assert {"--ntasks-per-node=4", "--cpus-per-task=8"} <= set(sbatch_lines_of(out))


def test_sbatch_names_dptrain_has_no_option_for_are_written_as_given(submit):
    code, out, err = submit("--dry-run", "--nodes", "2", "--gpus", "8", "-w", "dgx[01-02]", "--exclude", "dgx03",
                            "--mail-type", "END", "--mail-user", "ada@example.org", *DATA)
    assert code == 0, err
    lines = sbatch_lines_of(out)
    assert lines[-5:] == ["--gpus=8", "--nodelist=dgx[01-02]", "--exclude=dgx03", "--mail-type=END",
                          "--mail-user=ada@example.org"]
    assert "2 nodes x 4 ranks (one srun task per rank, nccl on GPUs)" in out  # --gpus 8: 4 GPUs on each of 2 nodes
    assert "dptrain: note" not in err  # submit's own option, not a tutorials' spelling to translate
    code, out, err = submit("--dry-run", "--gres", "gpu:a100:2", "--sbatch", "hold", *DATA)
    assert code == 0, err
    assert sbatch_lines_of(out)[-2:] == ["--hold", "--gres=gpu:a100:2"] and "1 node x 2 ranks" in out


def test_output_and_error_move_the_job_log_and_submit_prints_the_real_one(submit, tmp_path, monkeypatch):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text("#!/bin/sh\necho 4242\n")
    (fake / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", str(fake))  # and no sinfo: the partition is not checked
    code, out, err = submit("--job-name", "fmnist", "--output", "logs/%x-%j.out", *DATA)
    assert code == 0, err
    script = (tmp_path / "runs/synthetic_mnist-cnn_ddp/job.sbatch").read_text()  # the run's name: the experiment's
    lines = sbatch_lines_of(script)
    assert lines[0] == "--job-name=fmnist"
    assert f"--output={tmp_path}/logs/%x-%j.out" in lines
    assert f"--error={tmp_path}/logs/%x-%j.out" in lines  # as sbatch does: the errors go with the output
    assert f"  follow it: tail -f {tmp_path}/logs/fmnist-4242.out\n" in out
    assert (tmp_path / "logs").is_dir()  # SLURM writes no file into a folder that is not there
    code, out, err = submit("--output", "out/run.log", "--error", "out/run.err", *DATA)
    assert code == 0, err
    lines = sbatch_lines_of((tmp_path / "runs/synthetic_mnist-cnn_ddp/job.sbatch").read_text())
    assert {f"--output={tmp_path}/out/run.log", f"--error={tmp_path}/out/run.err"} <= set(lines)
    assert f"  follow it: tail -f {tmp_path}/out/run.log\n" in out


@pytest.mark.parametrize("line, instead", [
    ("ntasks-per-node=4", "--ranks-per-node (slurm.ranks_per_node)"),
    ("--nodes=2", "--nodes (slurm.nodes)"),
    ("-N 2", "--nodes (slurm.nodes)"),
    ("time=01:00:00", "--time (slurm.time)"),
    ("cpus-per-task=4", "--cpus-per-node (slurm.cpus_per_node)"),
    ("signal=USR1@60", "--signal-lead-s (slurm.signal_lead_s)"),
    ("job-name=x", "dptrain submit's --job-name NAME"),
    ("-J x", "dptrain submit's --job-name NAME"),
    ("output=/tmp/x.out", "dptrain submit's --output FILE"),
    ("-e /tmp/x.err", "dptrain submit's --error FILE"),
])
def test_an_sbatch_line_that_repeats_dptrains_own_option_is_refused_naming_the_one_to_use(submit, tmp_path, line,
                                                                                           instead):
    code, out, err = submit("--dry-run", f"--sbatch={line}", *DATA)
    assert code == 2 and out == ""
    option = line.split("=")[0].split()[0]
    option = option if option.startswith("-") else "--" + option
    assert err.strip().splitlines() == [f"dptrain: error: slurm.sbatch's line {line!r} sets sbatch's {option}, which "
                                        f"dptrain writes itself; give {instead} instead."]
    assert not (tmp_path / "runs").exists()


def test_a_one_letter_sbatch_option_without_its_dash_is_refused(submit, tmp_path):
    code, out, err = submit("--dry-run", "--sbatch", "w=dgx01", *DATA)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "dptrain: error: slurm.sbatch's line 'w=dgx01' is sbatch's one-letter option -w without its dash, which sbatch "
        "would not read as -w (written as '#SBATCH --w=dgx01'); write it as '-w VALUE', or by the option's long name "
        "(NAME=VALUE)."]
    code, out, err = submit("--dry-run", "--sbatch=-w dgx01", *DATA)  # with its dash: as given
    assert code == 0 and "\n#SBATCH -w dgx01\n" in out, err
