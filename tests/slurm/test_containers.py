"""Jobs whose ranks run in a container (slurm.container_image, slurm.container_env_file, slurm.container_engine): the
scripts as text (golden files beside test_submit.py's), the srun lines, the refusals, and the requeue from outside
the container. No container engine (pyxis/enroot, apptainer) is installed here: these check the lines the job
runs, not a job in a container (the requeue runs as a real job on the private cluster, a stand-in for the engine).

To rewrite the golden files after an intended change: DPTRAIN_REGOLD=1 pytest tests/slurm/test_containers.py (each
golden test then fails, saying it rewrote its file and compared nothing), read the diff, then run it again without.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import time
from pathlib import Path
from typing import Any

import pytest

from dptrain import config as config_mod
from dptrain.cli import main
from dptrain.config import SlurmConfig
from dptrain.errors import ConfigError
from dptrain.slurm import containers as slurm_containers, job as slurm_job, requeue as slurm_requeue, script as slurm_script
from tests.conftest import assert_matches_golden
from tests.slurm_cluster import TERMINAL_STATES

pytestmark = pytest.mark.usefixtures("no_slurm_clients")  # their submits are dry runs: no SLURM on PATH (conftest)

GOLDEN = Path(__file__).parent / "golden"
WORKDIR = Path("/home/ada/project")  # where the user ran `dptrain submit`, as in test_submit.py's golden files
NGC = "nvcr.io#nvidia/pytorch:25.01-py3"  # pyxis's (enroot's) name of a registry image
DATA = ["--data.name", "synthetic"]

# name -> (slurm.* options, the folder dptrain's source is in: None where the image holds dptrain)
CASES: dict[str, tuple[dict[str, Any], Path | None]] = {
    # pyxis, one task per rank; dptrain's checkout lies outside the project (a third mount); the script requeues
    "gpu-2nodes-4gpus-pyxis": ({"nodes": "2", "gpus_per_node": "4", "time": "02:00:00", "partition": "gpu",
                                "container_image": NGC, "requeue": "true"}, Path("/home/ada/dptrain/src")),
    # apptainer, one agent per node, a registry image; the image holds dptrain
    "gpu-2nodes-4gpus-agent-apptainer": ({"nodes": "2", "gpus_per_node": "4", "mode": "agent", "time": "02:00:00",
                                          "container_image": "docker://nvcr.io/nvidia/pytorch:25.01-py3",
                                          "container_engine": "apptainer", "setup": ("module load apptainer",)},
                                         None),
    # an environment file by name (~/.edf/pytorch.toml, as the seed's cluster keeps them), a CPU job
    "cpu-2nodes-edf": ({"nodes": "2", "cpus_per_node": "16", "ranks_per_node": "2", "partition": "normal",
                        "container_env_file": "pytorch"}, WORKDIR / "src"),
}


def rendered(slurm: dict[str, Any], source: Path | None, monkeypatch, workdir: Path = WORKDIR,
             pairs: tuple[tuple[str, str], ...] = ()) -> str:
    """The script of a run with these slurm.* options (set-up lines as a tuple), as `dptrain submit` writes it from
    workdir."""
    monkeypatch.setattr(slurm_containers, "dptrain_source", lambda: source)
    options = {k: v for k, v in slurm.items() if k != "setup"}
    cfg = config_mod.load(None, [*((f"slurm.{k}", v) for k, v in options.items()), *pairs])
    if "setup" in slurm:  # as the CLI's --setup lines replace the file's
        cfg = dataclasses.replace(cfg, slurm=dataclasses.replace(cfg.slurm, setup=slurm["setup"]))
    return slurm_script.render(cfg, slurm_job.job_for(cfg, workdir))


def srun_line(script: str) -> str:
    [line] = [line for line in script.splitlines() if line.startswith("srun ")]
    return line


@pytest.mark.parametrize("name", CASES)
def test_container_job_scripts_match_the_golden_files(name, monkeypatch):
    assert_matches_golden(rendered(*CASES[name], monkeypatch), GOLDEN / f"{name}.sbatch")


def test_pyxis_mounts_the_project_the_run_directory_outside_it_and_dptrains_checkout(monkeypatch):
    script = rendered({"container_image": NGC}, Path("/opt/dptrain/src"), monkeypatch,
                      pairs=(("output.dir", "/scratch/ada/run1"),))
    assert srun_line(script) == (
        f"srun --kill-on-bad-exit=1 '--container-image={NGC}' --container-mounts=/home/ada/project,/scratch/ada/run1,"
        f"/opt/dptrain/src --container-workdir=/home/ada/project env PYTHONPATH=/opt/dptrain/src python -m dptrain "
        f"train --config /scratch/ada/run1/job.toml")


def test_a_run_directory_inside_the_project_is_not_mounted_twice_and_an_installed_dptrain_adds_nothing(monkeypatch):
    line = srun_line(rendered({"container_image": NGC}, None, monkeypatch))
    assert "--container-mounts=/home/ada/project " in line
    assert "PYTHONPATH" not in line and " python -m dptrain train " in line


@pytest.mark.parametrize("gpus, nv", [("4", True), ("0", False)])
def test_apptainer_passes_the_gpus_in_only_on_a_gpu_job(monkeypatch, gpus, nv):
    line = srun_line(rendered({"container_image": "docker://pytorch/pytorch", "container_engine": "apptainer",
                               "gpus_per_node": gpus}, None, monkeypatch))
    assert line.startswith("srun --kill-on-bad-exit=1 apptainer exec ")
    assert ("--nv" in line.split()) == nv
    assert "--bind /home/ada/project --pwd /home/ada/project docker://pytorch/pytorch python -m dptrain" in line


@pytest.mark.parametrize("slurm, written", [
    ({"container_image": "images/torch.sqsh"}, "--container-image={}/images/torch.sqsh"),
    ({"container_image": "./images/torch.sqsh"}, "--container-image={}/images/torch.sqsh"),
    ({"container_image": "images/torch.sif", "container_engine": "apptainer"}, " {}/images/torch.sif "),
    ({"container_env_file": "images/edf.toml"}, "--environment={}/images/edf.toml"),
])
def test_a_local_image_or_environment_file_is_written_as_its_absolute_path(tmp_path, monkeypatch, slurm, written):
    (tmp_path / "images").mkdir()
    for name in ("torch.sqsh", "torch.sif"):
        (tmp_path / "images" / name).write_bytes(b"hsqs")
    (tmp_path / "images" / "edf.toml").write_text(f'image = "nvcr.io#nvidia/pytorch:25.01-py3"\n'
                                                  f'mounts = ["{tmp_path}:{tmp_path}"]\n')
    assert written.format(tmp_path) in srun_line(rendered(slurm, None, monkeypatch, workdir=tmp_path))


@pytest.mark.parametrize("slurm, sentence", [
    ({"container_image": "torch.sqsh"}, "slurm.container_image = 'torch.sqsh' names a file that is not there ({}/"
                                        "torch.sqsh); give the path of the image file, absolute or relative to {}, or "
                                        "a registry image as the engine names one."),
    ({"container_image": "torch.sif", "container_engine": "apptainer"}, "slurm.container_image = 'torch.sif' names a "
                                                                        "file that is not there"),
    ({"container_env_file": "./edf.toml"}, "slurm.container_env_file = './edf.toml' names a file that is not there "
                                           "({}/edf.toml); give the path of the environment file (.toml), absolute or "
                                           "relative to {}, or the name of one in ~/.edf."),
])
def test_a_container_file_that_is_not_there_is_refused_in_one_sentence(tmp_path, monkeypatch, slurm, sentence):
    with pytest.raises(ConfigError) as caught:
        rendered(slurm, None, monkeypatch, workdir=tmp_path)
    assert sentence.format(tmp_path, tmp_path) in str(caught.value)


@pytest.mark.parametrize("slurm", [{"container_env_file": "{}"},
                                   {"container_image": "{}", "container_engine": "apptainer"}])
@pytest.mark.parametrize("given, what", [
    ("/etc", "/etc, a folder, not a file"),
    ("/dev/zero", "/dev/zero, which is not a regular file (a device, a pipe or a socket)"),  # read, it never ends
    ("link.toml", "{}/link.toml, a folder, not a file"),  # a link is followed, as the engine follows it
])
def test_a_container_file_that_is_there_but_no_file_says_what_it_is(tmp_path, monkeypatch, slurm, given, what):
    # Both were "a file that is not there".
    (tmp_path / "link.toml").symlink_to("/etc")
    options = {key: value.format(given) for key, value in slurm.items()}
    with pytest.raises(ConfigError) as caught:
        rendered(options, None, monkeypatch, workdir=tmp_path)
    name = next(iter(options))
    assert str(caught.value).startswith(f"slurm.{name} = {given!r} names {what.format(tmp_path)}; give the path of the ")


@pytest.mark.parametrize("slurm, word", [
    ({"container_image": NGC}, f"--container-image={NGC}"),
    ({"container_image": "ubuntu"}, "--container-image=ubuntu"),
    ({"container_image": "library://ada/torch", "container_engine": "apptainer"}, "library://ada/torch"),
    ({"container_env_file": "pytorch"}, "--environment=pytorch"),
], ids=["pyxis-registry", "pyxis-docker-hub", "apptainer-library", "edf-by-name"])
def test_registry_images_and_environments_by_name_are_not_looked_for_here(tmp_path, monkeypatch, slurm, word):
    # Found by the engine on the node (a registry, ~/.edf): nothing to check where the job is written (no file of
    # that name is here), and the srun line hands the name on as given, not as a path of the folder it was written in.
    assert word in shlex.split(srun_line(rendered(slurm, None, monkeypatch, workdir=tmp_path)))


def test_an_environment_file_that_is_not_toml_is_refused(tmp_path, monkeypatch):
    (tmp_path / "edf.toml").write_text("image = nvcr.io#nvidia/pytorch\n")
    with pytest.raises(ConfigError, match=r"slurm.container_env_file .*edf.toml is not valid TOML \(.*\), so srun "
                                          r"--environment cannot read it; fix the file, or give another.$"):
        rendered({"container_env_file": "edf.toml"}, None, monkeypatch, workdir=tmp_path)


def test_a_folder_to_mount_with_a_comma_is_refused(monkeypatch):
    with pytest.raises(ConfigError, match="^/data/a,b/run holds a comma or colon, which pyxis's list of folders to "
                                          "mount splits on; "):
        rendered({"container_image": NGC}, None, monkeypatch, pairs=(("output.dir", "/data/a,b/run"),))


@pytest.mark.parametrize("slurm, sentence", [
    ({"container_image": NGC, "container_env_file": "pytorch"},
     "slurm.container_image and slurm.container_env_file are two ways to give the container (the environment file "
     "names its own image); keep one of them."),
    ({"container_env_file": "pytorch", "container_engine": "apptainer"},
     "slurm.container_env_file is read by srun --environment (pyxis), not by apptainer; give the image as "
     "slurm.container_image instead, or drop slurm.container_engine."),
    ({"container_image": "/images/my torch.sqsh"},
     "slurm.container_image = '/images/my torch.sqsh' is empty or holds a space or control character, which the srun "
     "line cannot carry; give an image name or a path without spaces."),
    ({"container_env_file": ""}, "slurm.container_env_file = '' is empty"),
])
def test_container_options_that_do_not_make_one_container_are_refused(slurm, sentence):
    with pytest.raises(ConfigError) as caught:
        SlurmConfig(**slurm)
    assert str(caught.value).startswith(sentence)


def test_an_engine_without_an_image_is_refused_where_the_job_is_written(monkeypatch):
    # Not by the config alone: every value of a choice is a config of its own (tests/config/test_config.py).
    with pytest.raises(ConfigError) as caught:
        rendered({"container_engine": "apptainer"}, None, monkeypatch)
    assert str(caught.value) == ("slurm.container_engine = apptainer has no image to start; give slurm.container_image "
                                 "too, or drop slurm.container_engine.")


def test_the_python_in_a_container_is_the_images_unless_given():
    assert slurm_job.python_for(SlurmConfig(container_image=NGC)) == "python"
    conda = "/opt/conda/bin/python"
    assert slurm_job.python_for(SlurmConfig(container_image=NGC, python=conda)) == conda
    assert slurm_job.python_for(SlurmConfig()) != "python"  # this one, outside a container


def test_a_container_job_requeues_from_its_script_where_scontrol_is(monkeypatch):
    script = rendered({"container_image": NGC, "requeue": "true"}, None, monkeypatch)
    request = "/home/ada/project/runs/run/logs/requeue-$SLURM_JOB_ID"
    assert f'export DPTRAIN_REQUEUE="{request}"\n' in script and "DPTRAIN_REQUEUE=1" not in script
    assert ('  if [ -e "$DPTRAIN_REQUEUE" ]; then\n    rm -f "$DPTRAIN_REQUEUE"\n    scontrol requeue "$SLURM_JOB_ID" || '
            'echo "dptrain: could not requeue job $SLURM_JOB_ID; submit this script again to resume" >&2\n  fi\n}\n'
            'trap requeue_if_asked EXIT\n') in script
    assert script.splitlines()[-1] == srun_line(script)  # the launch line stays last (bench's peer jobs build on it)
    # without a container, rank 0 runs scontrol itself, as before
    plain = rendered({"requeue": "true"}, None, monkeypatch)
    assert "export DPTRAIN_REQUEUE=1 " in plain and "trap" not in plain


def test_rank_0_in_a_container_writes_the_request_instead_of_running_scontrol(tmp_path, monkeypatch):
    events: list[tuple[str, dict]] = []
    monkeypatch.setattr(slurm_requeue, "requeue", lambda job_id: events.append(("scontrol", {})))
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    request = tmp_path / "requeue-42"
    monkeypatch.setenv(slurm_requeue.REQUEUE_VAR, str(request))
    slurm_requeue.requeue_after_stop(7, lambda event, **fields: events.append((event, fields)))
    assert events == [("requeue", {"step": 7, "job_id": "42"})]
    assert request.read_text() == "7\n"
    # a request that cannot be written is recorded as a failed requeue
    events.clear()
    monkeypatch.setenv(slurm_requeue.REQUEUE_VAR, str(tmp_path / "missing" / "requeue-42"))
    slurm_requeue.requeue_after_stop(7, lambda event, **fields: events.append((event, fields)))
    assert [event for event, _ in events] == ["requeue", "requeue_failed"]
    assert events[1][1]["reason"].startswith(f"could not write {tmp_path / 'missing' / 'requeue-42'} (")


def test_submit_and_bench_take_the_container_options_on_the_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(slurm_containers, "dptrain_source", lambda: None)
    assert main(["submit", "--dry-run", "--container-image", NGC, *DATA]) == 0
    assert f"'--container-image={NGC}' --container-mounts={tmp_path} " in capsys.readouterr().out
    # bench --slurm builds each point's job from the same options (sweep.job_shape keeps them)
    assert main(["bench", "--slurm", "--dry-run", "--workers", "1,2", "--strategies", "ddp", "--nodes", "2",
                 "--container-image", "docker://pytorch/pytorch", "--container-engine", "apptainer", *DATA]) == 0
    scripts = capsys.readouterr().out.split("#!/bin/bash\n")[1:]
    assert len(scripts) == 2
    assert all(" apptainer exec --bind " in srun_line(script) for script in scripts)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank_asks", [True, False])
def test_the_script_requeues_the_job_when_rank_0_asked_even_as_srun_fails(slurm_cluster, tmp_path, monkeypatch,
                                                                           rank_asks):
    """The script as a real job on the private cluster, its own srun and scontrol (the head node's address, the
    requeue): only the container engine, which is not installed here, is a stand-in on PATH; it plays the rank in
    the container, which stops on the signal (exit 75) after writing the request, or not. apptainer, not pyxis,
    whose --container-image this srun (without the plugin) would refuse; both engines' scripts requeue alike."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    asks = 'echo 7 > "$DPTRAIN_REQUEUE"' if rank_asks else ":"  # rank 0 after the signal's snapshot, or not
    (bin_dir / "apptainer").write_text(f"#!/bin/sh\necho \"$MASTER_ADDR\" >> {tmp_path}/ranks.txt\n{asks}\nexit 75\n")
    (bin_dir / "apptainer").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")  # sbatch's --export=ALL takes it along
    script = rendered({"container_image": "docker://pytorch/pytorch", "container_engine": "apptainer",
                       "requeue": "true"}, None, monkeypatch, workdir=tmp_path)
    run_dir = tmp_path / "runs" / "run"
    (run_dir / "logs").mkdir(parents=True)  # as dptrain submit makes it
    (run_dir / "job.sbatch").write_text(script)
    job_id = slurm_cluster.sbatch(run_dir / "job.sbatch")
    try:
        record = requeued(slurm_cluster, job_id) if rank_asks else slurm_cluster.wait(job_id)
    finally:
        slurm_cluster.run("scancel", str(job_id))  # a requeued job would start again
    assert (tmp_path / "ranks.txt").read_text() == "127.0.0.1\n"  # srun ran the engine once, after scontrol's lines
    errors = (run_dir / "logs" / f"slurm-{job_id}.err").read_text()
    assert re.search(r"srun: error: n[12]: task 0: Exited with exit code 75", errors), errors
    assert record["Restarts"] == ("1" if rank_asks else "0"), record
    if not rank_asks:  # a requeued job's record starts afresh (ExitCode 0:0) as it waits to run again
        assert (record["JobState"], record["ExitCode"]) == ("FAILED", "75:0")  # the ranks' code, whatever came after
    assert not (run_dir / "logs" / f"requeue-{job_id}").exists()  # the rerun does not requeue again


def requeued(cluster, job_id: int) -> dict[str, str]:
    """The job's record once it has been put back in the queue (Restarts=1); fails if it ends instead."""
    while (record := cluster.job(job_id))["Restarts"] == "0":
        assert record["JobState"] not in TERMINAL_STATES, record
        time.sleep(0.1)
    return record


@pytest.mark.parametrize("mounts, refused", [
    ('["/scratch:/scratch"]', True),                     # the run is not in the container at all
    ('["{0}:/workspace"]', True),                        # it is, at another path: job.toml's path is not there
    ("[]", True),
    ('["{0}:{0}"]', False),
    ('["{0}/:{0}:ro", "/scratch:/scratch"]', False),     # flags and a trailing slash: the same folder
    ('["{1}"]', False),                                  # a bare path: at its own path
    ('["$DPTRAIN_TEST_HOME:$DPTRAIN_TEST_HOME"]', False),  # variables, as the engine expands them
    ('["/scratch:/scratch"]\nbase_environment = "pytorch"', False),  # mounts from another file: the engine's
])
def test_an_environment_file_whose_mounts_miss_the_run_directory_is_refused(tmp_path, monkeypatch, mounts, refused):
    monkeypatch.setenv("DPTRAIN_TEST_HOME", str(tmp_path))
    (tmp_path / "edf.toml").write_text(f'image = "nvcr.io#nvidia/pytorch:25.01-py3"\n'
                                       f'mounts = {mounts.format(tmp_path, tmp_path / "runs")}\n')
    if not refused:
        assert "--environment=" in srun_line(rendered({"container_env_file": "edf.toml"}, None, monkeypatch,
                                                      workdir=tmp_path))
        return
    with pytest.raises(ConfigError) as caught:
        rendered({"container_env_file": "edf.toml"}, None, monkeypatch, workdir=tmp_path)
    assert str(caught.value) == (
        f"slurm.container_env_file {tmp_path}/edf.toml mounts no folder holding the run folder {tmp_path}/runs/run "
        f"at its own path, so the ranks could neither read its job.toml nor write the run; add "
        f'"{tmp_path}:{tmp_path}" to the file\'s mounts, or write the run under a folder it mounts (--output.dir).')
