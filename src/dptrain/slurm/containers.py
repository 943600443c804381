"""The container a job's ranks start in (slurm.container_image, slurm.container_env_file): how srun starts each task
in it, the folders it mounts, and the checks that it can start, made where the job is written.

pyxis's srun --container-image or --environment, or apptainer exec under srun. The script's own lines (scontrol, the
set-up lines) run on the node as it is; the container sees the folder dptrain submit ran in and the run folder at
their own paths, and has no scontrol (the script requeues the job itself once srun returns: script.py).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dptrain.config import SlurmConfig, read_toml
from dptrain.errors import ConfigError

# Where an image option names a file rather than a registry image: pyxis takes a path (/..., ./...) to a squashfs
# file; apptainer takes a path unless a scheme (docker://, library://, oras://, docker-archive:) says otherwise.
PYXIS_IMAGE_FILES = (".sqsh", ".squashfs")
IMAGE_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
CONTAINER_SHOWN = {"pyxis": "in a pyxis container", "edf": "in the container of an environment file",
                   "apptainer": "in an apptainer container"}


def check_container(s: SlurmConfig, run_dir: Path, workdir: Path) -> None:
    """ConfigError in one sentence where the job's container cannot start: an engine with no image, an image or
    environment file that is a file not there (or not TOML), or a folder to mount holding a character the engine's
    mount list splits on. Made where the job is written: a rank reads the same config, where the files may not be."""
    engine = s.container_engine
    if engine != "pyxis" and s.container is None:  # pyxis is the default, which asks for nothing alone
        raise ConfigError(f"slurm.container_engine = {engine} has no image to start; give slurm.container_image too, "
                          f"or drop slurm.container_engine.")
    if s.container is None:
        return
    name, value = ("container_env_file", s.container_env_file) if s.container == "edf" else ("container_image",
                                                                                            s.container_image)
    local = container_file(s)
    if local is not None:
        path = container_path(local, workdir)
        if not path.is_file():  # follows a link, as the engine does; reading a device (/dev/zero) would never end
            kind, other = (("environment file (.toml)", "the name of one in ~/.edf") if s.container == "edf" else
                           ("image file", "a registry image as the engine names one"))
            what = (f"{path}, a folder, not a file" if path.is_dir() else
                    f"{path}, which is not a regular file (a device, a pipe or a socket)" if path.exists() else
                    f"a file that is not there ({path})")
            raise ConfigError(f"slurm.{name} = {value!r} names {what}; give the path of the {kind}, absolute or "
                              f"relative to {workdir}, or {other}.")
        if s.container == "edf":
            try:  # bounded, as every TOML read: a planted file may be of any size
                environment = read_toml(path, f"slurm.container_env_file {path}")
            except ConfigError as exc:
                raise ConfigError(f"{str(exc).split('; ')[0]}, so srun --environment cannot read it; fix the file, or "
                                  f"give another.") from None
            check_env_file_mounts(environment, path, run_dir, workdir)
    if s.container != "edf":  # an environment file names its own mounts
        for folder in container_mounts(run_dir, workdir, dptrain_source()):
            if any(c in ",:" for c in str(folder)):
                raise ConfigError(f"{folder} holds a comma or colon, which {s.container}'s list of folders to mount "
                                  f"splits on; run from, and write the run to, folders without them.")


def check_env_file_mounts(environment: dict[str, Any], path: Path, run_dir: Path, workdir: Path) -> None:
    """ConfigError in one sentence where an environment file mounts no folder holding the run folder at its own
    path: the ranks read the run's job.toml by its path and write the run there. Its mounts are "SOURCE:TARGET[:FLAGS]"
    (a bare "PATH": at its own path), with $VARIABLES as the engine expands them. A file that takes more of its
    environment from others (base_environment) is left to the engine, which reads those."""
    if "base_environment" in environment:
        return
    mounts = environment.get("mounts", [])
    for mount in mounts if isinstance(mounts, list) else []:
        if not isinstance(mount, str):
            continue
        source, _, rest = os.path.expanduser(os.path.expandvars(mount)).partition(":")
        target = rest.partition(":")[0] or source
        if source and Path(source) == Path(target) and run_dir.is_relative_to(source):
            return
    folder = workdir if run_dir.is_relative_to(workdir) else run_dir
    raise ConfigError(f"slurm.container_env_file {path} mounts no folder holding the run folder {run_dir} at its "
                      f"own path, so the ranks could neither read its job.toml nor write the run; add "
                      f"\"{folder}:{folder}\" to the file's mounts, or write the run under a folder it mounts "
                      f"(--output.dir).")


@dataclass(frozen=True)
class ContainerLaunch:
    """How srun starts each task in the job's container: srun's own options, the words before the task's command,
    and the script's comment lines saying so. All empty where the job has no container."""

    srun_options: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    said: tuple[str, ...] = ()


def container_launch(s: SlurmConfig, run_dir: Path, workdir: Path) -> ContainerLaunch:
    """The job's ContainerLaunch (the same for the same inputs: render's golden tests compare it). pyxis and apptainer
    mount the folder dptrain submit runs in (the project: its data, and the run folder where it lies inside) at
    its own path, and the run folder where it lies outside, and start the ranks in that folder, as the script's
    --chdir does outside a container; an environment file names its own mounts and workdir."""
    if s.container is None:
        return ContainerLaunch()
    source = dptrain_source()
    command: tuple[str, ...] = ()
    said: list[str] = []
    if source is not None:  # the job.toml this dptrain wrote is read by the same dptrain, whatever the image holds
        command = ("env", f"PYTHONPATH={source}")
        said.append(f"PYTHONPATH: the dptrain that wrote this job (its source, {source}), ahead of any in the image.")
    if s.container == "edf":
        path = container_file(s)
        env_file = str(container_path(path, workdir)) if path is not None else s.container_env_file
        said.insert(0, "Each task starts in the container this environment file describes: its image, mounts, workdir.")
        return ContainerLaunch((f"--environment={env_file}",), command, tuple(said))
    image = s.container_image
    assert image is not None, "a container of an image"
    path = container_file(s)
    if path is not None:
        image = str(container_path(path, workdir))
    folders = container_mounts(run_dir, workdir, source)
    mounts = ",".join(map(str, folders))
    said.insert(0, f"Each task starts in the image ({s.container}) with {' and '.join(map(str, folders))} mounted at "
                   f"{'its own path' if len(folders) == 1 else 'their own paths'}, the ranks in {workdir}.")
    if s.container == "pyxis":
        return ContainerLaunch((f"--container-image={image}", f"--container-mounts={mounts}",
                                f"--container-workdir={workdir}"), command, tuple(said))
    gpu = ("--nv",) if s.gpus_here else ()  # the host's NVIDIA driver and devices, inside the container
    return ContainerLaunch((), ("apptainer", "exec", *gpu, "--bind", mounts, "--pwd", str(workdir), image, *command),
                           tuple(said))


def container_file(s: SlurmConfig) -> str | None:
    """The local file that the container option names, as given; None where it names a registry image (pyxis:
    nvcr.io#nvidia/pytorch:TAG; apptainer: docker://..., library://...) or an environment file in ~/.edf by name."""
    if s.container == "edf":
        value = s.container_env_file or ""
        return value if "/" in value or value.endswith(".toml") else None
    image = s.container_image or ""
    if s.container == "apptainer":
        return None if IMAGE_SCHEME.match(image) else image
    if s.container == "pyxis" and (image.startswith(("/", ".", "~")) or image.endswith(PYXIS_IMAGE_FILES)):
        return image
    return None


def container_path(value: str, workdir: Path) -> Path:
    """A container file's path as the job names it: absolute (a relative one is the submit folder's)."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else workdir / path


def container_mounts(run_dir: Path, workdir: Path, source: Path | None) -> list[Path]:
    """The folders a container of an image mounts: the submit folder, then the run folder and dptrain's source
    where they lie outside the folders before them."""
    folders = [workdir]
    for folder in (run_dir, source):
        if folder is not None and not any(folder.is_relative_to(f) for f in folders):
            folders.append(folder)
    return folders


def dptrain_source() -> Path | None:
    """The folder holding this dptrain package where it runs from a source checkout (pip install -e): a container
    job mounts it and puts it on PYTHONPATH. None where dptrain is installed in site-packages: the host's packages
    are built for the host's Python, and the image must hold its own dptrain then."""
    root = Path(__file__).resolve().parents[2]  # <root>/dptrain/slurm/containers.py
    return None if root.name in ("site-packages", "dist-packages") else root
