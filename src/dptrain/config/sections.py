"""The sections of RunConfig, one frozen dataclass each, whose field docstrings are the reference for the option of
the same dotted name (`--optim.lr 3e-4` sets `OptimConfig.lr`; config.help reads them for --help). Checks of a value's
range, or of several options together, live in `__post_init__`; every float option must also fit 32-bit floats."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

from dptrain.config.choices import DATASET_NAMES, MODEL_NAMES, TRACKERS
from dptrain.option_fields import (MAY_CHANGE_AT_RESUME, SHOWN_DEFAULT, field_types, is_table, may_change_at_resume,
                                   name_or_import_path, not_negative, positive, shown)
from dptrain.config.slurm import SlurmConfig
from dptrain.strategies.catalog import StrategyConfig
from dptrain.errors import ConfigError
from dptrain.run_folder import RunFolder


MIN_TIMEOUT_S = 1.0  # starting the workers and the first collective take seconds: a shorter bound fails healthy runs
# A week bounds any wait a healthy run has; in milliseconds it fits even a 32-bit int. 1e10 s overflowed c10d's
# deadline (a 64-bit count of nanoseconds) and failed every multi-process run.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# 32-bit floats' range (torch.finfo(torch.float32): max, and tiny, the smallest normal magnitude), which every float
# option must fit: a rate, a decay, an eps or a bound meets the run's float32 tensors, where --optim.lr 1e308 failed
# SGD's first step ("value cannot be converted to type float without overflow", naming no option) and an eps of
# 1e-320 became 0. The options in seconds or MiB have bounds of their own, checked first, far inside it.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38


TrackerName = Literal[tuple(TRACKERS)]  # type: ignore[valid-type]  # config.choices' TRACKERS: the one list of them
"""output.trackers' choices."""
Augment = Literal["none", "crop-flip"]
"""data.augment's choices: the augmentations of dptrain.data.augment."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    name: str = "fashion-mnist"
    """fashion-mnist, mnist, cifar10, synthetic, or `package.module:Factory` called as
    `Factory(root=data.root, train=True|False)` returning a map-style torch Dataset."""
    root: str = may_change_at_resume("data")
    """Folder searched first for dataset files (torchvision layouts or plain files); downloads go here."""
    download: bool = may_change_at_resume(False)
    """Fetch missing files from the official mirrors (md5-checked, once per machine under a file lock)."""
    mirror: str | None = may_change_at_resume(None)
    """Base URL tried before the official mirrors, e.g. a site-local copy."""
    synthetic_train_size: int = 4096
    """Samples in the synthetic training split."""
    synthetic_test_size: int = 1000
    """Samples in the synthetic test split."""
    synthetic_shape: tuple[int, int, int] = (1, 28, 28)
    """Channels, height, width of synthetic images."""
    synthetic_num_classes: int = 10
    """Classes of the synthetic dataset."""
    num_workers: int = may_change_at_resume(0)
    """DataLoader workers per rank; used only for a user's Dataset (built-in data lives on the device)."""
    augment: Augment = "none"
    """Training augmentation on the device: none, or crop-flip (random crop of the 4-pixel zero-padded image,
    then a horizontal flip half the time; each draw a function of train.seed, epoch and sample index, so
    the same whatever the world size and after a resume). Evaluation never augments."""

    def __post_init__(self) -> None:
        name_or_import_path(self.name, "data.name", DATASET_NAMES)
        positive(self.synthetic_train_size, "data.synthetic_train_size")
        positive(self.synthetic_test_size, "data.synthetic_test_size")
        if len(self.synthetic_shape) != 3 or min(self.synthetic_shape) <= 0:
            raise ConfigError(f"data.synthetic_shape = {list(self.synthetic_shape)} must be three positive sizes [C, H, W].")
        if self.synthetic_num_classes < 2:
            raise ConfigError(f"data.synthetic_num_classes = {self.synthetic_num_classes} must be at least 2.")
        not_negative(self.num_workers, "data.num_workers")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = "mnist-cnn"
    """mnist-cnn, cifar-cnn, resnet18, or `package.module:ClassName` (constructed with no arguments)."""
    dropout: bool = True
    """False replaces every nn.Dropout by identity (for exact cross-world-size comparisons)."""
    sync_batchnorm: bool = False
    """True turns every BatchNorm layer into torch.nn.SyncBatchNorm: batch statistics over the global batch (every
    rank's share) instead of each rank's, the math of one process with the same global batch. For models with
    BatchNorm (resnet18), under strategy ddp or zero1 on GPUs (torch's SyncBatchNorm takes no CPU tensors)."""

    def __post_init__(self) -> None:
        name_or_import_path(self.name, "model.name", MODEL_NAMES)


OPTIMIZER_CLASSES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}
"""optim.name -> its class in torch.optim (strategies.base.OPTIMIZERS imports them): the one list of the choice."""
OptimizerName = Literal[tuple(OPTIMIZER_CLASSES)]  # type: ignore[valid-type]  # OPTIMIZER_CLASSES' names


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    name: OptimizerName = "adam"
    """Optimizer."""
    lr: float = 1e-3
    """Peak learning rate, for the global batch (not scaled by world size; see scale_lr_with)."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 0.0
    """L2 penalty (decoupled for adamw)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """For adam and adamw: decay rates of the running means of the gradient and of its square (torch's defaults)."""
    eps: float = 1e-8
    """For adam and adamw: added to the root of the squared-gradient mean, so that a step never divides by 0."""
    schedule: Literal["constant", "cosine", "onecycle", "step"] = "constant"
    """Learning-rate schedule over the run's optimizer steps."""
    step_epochs: int = 1
    """For schedule "step": epochs between learning-rate drops."""
    gamma: float = 0.1
    """For schedule "step": factor applied at each drop."""
    warmup_steps: int = 0
    """Optimizer steps over which the learning rate rises linearly from 0 to the schedule's, on top of any schedule;
    counted in the run's steps (0: no warm-up)."""
    scale_lr_with: Literal["none", "linear", "sqrt"] = "none"
    """Scale optim.lr by global_batch_size / reference_batch_size (linear) or its square root (sqrt): the
    large-batch recipe, so that one lr serves several batch sizes."""
    reference_batch_size: int = 256
    """The global batch size optim.lr is meant for, when scale_lr_with scales it."""

    def peak_lr(self, global_batch_size: int) -> float:
        """lr, scaled to the global batch as scale_lr_with says (the large-batch recipe)."""
        ratio = global_batch_size / self.reference_batch_size
        return self.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[self.scale_lr_with]

    def __post_init__(self) -> None:
        positive(self.lr, "optim.lr")
        not_negative(self.warmup_steps, "optim.warmup_steps")
        positive(self.reference_batch_size, "optim.reference_batch_size")
        not_negative(self.momentum, "optim.momentum")
        not_negative(self.weight_decay, "optim.weight_decay")
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise ConfigError(f"optim.betas = {list(self.betas)} must be two numbers from 0 up to (not including) 1, "
                              f"like 0.9,0.999.")
        positive(self.eps, "optim.eps")
        positive(self.step_epochs, "optim.step_epochs")
        positive(self.gamma, "optim.gamma")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    epochs: int = may_change_at_resume(2)
    """Passes over the training split."""
    max_steps: int | None = may_change_at_resume(None)
    """Stop after this many optimizer steps, even mid-epoch (None: run all epochs)."""
    global_batch_size: int = 128
    """Samples per optimizer step over all ranks; each rank takes global_batch_size / world_size."""
    batch_size_per_rank: int | None = may_change_at_resume(None)
    """The tutorials' batch instead: samples per forward pass on each rank that takes data (a micro-batch where
    train.accumulate_steps is above 1). The global batch is then this times those ranks times train.accumulate_steps
    (Lightning's rule), printed and saved as train.global_batch_size: it changes with the world size, and with it what
    a step computes (a resume at another world size is refused). None: train.global_batch_size decides."""
    accumulate_steps: int = may_change_at_resume(1)
    """Micro-batches per optimizer step: each rank's share of the global batch goes through forward and backward in
    this many pieces, whose gradients are summed on the rank and synchronised once, with the last (DDP's no_sync,
    FSDP2's set_requires_gradient_sync); the same math as the whole share at once, with the activations of one piece.
    train.global_batch_size stays the samples of one optimizer step, so it must divide by the ranks that take data
    times this. Snapshots are taken between optimizer steps only. Lightning's --accumulate_grad_batches, DeepSpeed's
    gradient_accumulation_steps."""
    eval_batch_size: int = may_change_at_resume(128)
    """Samples per evaluation forward pass on each rank. Small batches keep the activations in the CPU's caches:
    the tutorials' CNN evaluates 2.3x faster on one core at 128 than at 1000, and holds about 200 MB less."""
    seed: int = 0
    """Seeds the model init, the data order and every rank's RNG."""
    bf16: bool = False
    """Autocast the forward pass to bfloat16."""
    fp16: bool = False
    """On GPUs: autocast the forward pass to float16 and scale the loss with torch.amp.GradScaler, for GPUs without
    bfloat16 (V100, T4). A step whose scaled gradients overflow is skipped (its update not applied, the scale
    halved), counted in the epoch's skipped_steps; the scaler's state is kept in snapshots. With strategies ddp, zero1
    and single; not on the CPU (train.bf16 is the CPU's 16-bit autocast), nor with train.bf16 or train.cuda_graph."""
    deterministic: bool = may_change_at_resume(False)
    """On CUDA, deterministic kernels only (cuDNN, cuBLAS, no atomic adds), so that a run repeats bit for bit and
    resumes bit-identical; slower. A kernel with no deterministic version warns. The CPU path is deterministic anyway."""
    cuda_graph: bool = may_change_at_resume(False)
    """On one GPU (strategies single, ddp or dp with one process), capture the whole training step as a CUDA
    graph and replay it: one launch instead of dozens per step, for small models whose steps are
    launch-bound. Needs optim.name adam or adamw and a schedule other than onecycle; ignored, with a
    warning, on the CPU and for strategies that communicate inside the step."""
    compile: bool = may_change_at_resume(False)
    """Compile the model's training forward and backward with torch.compile (inductor): fused kernels, fewer
    launches; the first steps wait for the compiler (tens of seconds). It pays on GPUs; on the CPU inductor's
    dropout and max-pool kernels made the tutorials' CNN slower than dptrain's eager path here (measure with
    `python perf/speed.py`). Evaluation stays eager. Not with strategy dp or train.cuda_graph."""
    grad_clip: float | None = None
    """Clip the global gradient norm to this value (None: no clipping)."""
    log_every: int = may_change_at_resume(50)
    """Optimizer steps between step events; each one costs a host sync and a collective."""
    progress_every_s: float = may_change_at_resume(30.0)
    """When stdout is not a terminal (a SLURM output file, a pipe), rank 0 logs a plain progress line this often:
    epoch, step of the run's total, images/s, ETA (0: none). A terminal shows a live bar instead."""
    channels_last: bool = True
    """Store activations NHWC; faster convolutions on most CPUs and GPUs, same results to float tolerance."""
    resume: str = may_change_at_resume("auto")
    """auto: continue from the newest valid snapshot in the run folder; never; or a snapshot folder."""
    eval_every_epochs: int = may_change_at_resume(1)
    """Evaluate on the test split after every this many epochs (0: only at the end); the run's last epoch, or the
    partial epoch a train.max_steps stop ends in, is always evaluated."""
    profile: str | None = may_change_at_resume(None)
    """FIRST:LAST, such as 10:15: torch.profiler records the run's optimizer steps FIRST to LAST (counted from 1, as
    the step events count them) on every rank, CPU activities and CUDA's where the ranks run on GPUs; each rank's
    trace goes to tb/profile/rank<R>.<time>.pt.trace.json in the run folder once step LAST (or the run's last step)
    is done, for TensorBoard's profiler plugin, Perfetto or chrome://tracing. None: no profiling."""

    @property
    def profiled_steps(self) -> tuple[int, int] | None:
        """train.profile as (first, last) step, both included; None without it."""
        if self.profile is None:
            return None
        first, last = self.profile.split(":")
        return int(first), int(last)

    def total_steps(self, steps_per_epoch: int) -> int:
        """The run's optimizer steps: every epoch's, cut at max_steps."""
        total = self.epochs * steps_per_epoch
        return total if self.max_steps is None else min(total, self.max_steps)

    def __post_init__(self) -> None:
        positive(self.epochs, "train.epochs")
        not_negative(self.eval_every_epochs, "train.eval_every_epochs")
        if self.max_steps is not None:
            positive(self.max_steps, "train.max_steps")
        positive(self.global_batch_size, "train.global_batch_size")
        if self.batch_size_per_rank is not None:
            positive(self.batch_size_per_rank, "train.batch_size_per_rank")
        positive(self.accumulate_steps, "train.accumulate_steps")
        positive(self.eval_batch_size, "train.eval_batch_size")
        positive(self.log_every, "train.log_every")
        not_negative(self.progress_every_s, "train.progress_every_s")
        if self.grad_clip is not None:
            positive(self.grad_clip, "train.grad_clip")
        if self.profile is not None and not (re.fullmatch(r"[0-9]{1,9}:[0-9]{1,9}", self.profile)
                                             and 1 <= int(self.profile.split(":")[0])
                                             <= int(self.profile.split(":")[1])):
            raise ConfigError(f"train.profile = {shown(self.profile)} is not a range of steps; give FIRST:LAST with "
                              f"1 <= FIRST <= LAST, such as 10:15 (the run's optimizer steps, counted from 1).")


# The flat keys of [strategy] before each strategy had its table (strategy.comm_hook, ...), each with its table's key:
# no release ever read them, so a config that gives one is refused with the new spelling (codec.refuse_flat_keys).
LEGACY_STRATEGY_KEYS = {
    **{f.name: f"{table.name}.{f.name}" for table in dataclasses.fields(StrategyConfig) if table.name != "name"
       for f in dataclasses.fields(table.default_factory)},  # type: ignore[arg-type]  # every table has a factory
    "deepspeed_config": "deepspeed.config",
}
LEGACY_STRATEGY_KEYS.pop("config")  # strategy.config never was a key: DeepSpeed's file was strategy.deepspeed_config
LEGACY_STRATEGY_KEYS.pop("devices")  # nor strategy.devices: [strategy.dp] came after the tables
LEGACY_STRATEGY_KEYS.pop("bucket_mb")  # nor strategy.bucket_mb: it came after them too


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    nproc_per_node: int | Literal["auto"] = may_change_at_resume("auto")
    """Local workers started through torch's elastic agent (ignored under torchrun or srun); auto: one per visible
    GPU (as the tutorials' world_size = torch.cuda.device_count()), one for strategies single and dp (one process
    drives every GPU), one on a machine without (it uses every core)."""
    device: Literal["auto", "cpu", "cuda"] = may_change_at_resume("auto")
    """auto: cuda:<local_rank> when CUDA is available, else cpu."""
    backend: Literal["auto", "nccl", "gloo"] = may_change_at_resume("auto")
    """Collective backend: auto is nccl on GPUs and gloo on the CPU; gloo on GPUs is the fallback to try when nccl
    misbehaves (slower: it stages tensors through host memory for some collectives)."""
    timeout_s: float = may_change_at_resume(300.0)
    """Seconds (1 to 604800, a week) bounding rendezvous and any collective; a missing peer fails the run after this."""
    max_restarts: int = may_change_at_resume(0)
    """Times the elastic agent restarts the local workers after one fails; each restart resumes from the newest snapshot."""
    watch: bool = may_change_at_resume(True)
    """Each rank watches its collectives for a hang (the run then ends naming the rank that stopped, docs/hangs.md) and
    times its own work for stragglers (named in the epoch event); false leaves both out, to measure what they cost."""
    leave_slow_node: int = may_change_at_resume(0)
    """With --nnodes MIN:MAX: a node whose rank is named the straggler this many epochs in a row leaves the run at that
    epoch's end, after a snapshot of it, and the other nodes go on from it (while more than MIN nodes remain; needs
    launch.max_restarts 1 or more and launch.watch); 0: no node leaves (docs/hangs.md)."""

    def __post_init__(self) -> None:
        if self.nproc_per_node != "auto":
            positive(self.nproc_per_node, "launch.nproc_per_node")
        not_negative(self.max_restarts, "launch.max_restarts")
        not_negative(self.leave_slow_node, "launch.leave_slow_node")
        if self.timeout_s < MIN_TIMEOUT_S:
            raise ConfigError(f"launch.timeout_s = {self.timeout_s:g} is below the minimum of {MIN_TIMEOUT_S:g} s: it bounds "
                              f"the rendezvous and every collective, and starting the workers alone takes longer than that; "
                              f"set {MIN_TIMEOUT_S:g} or more (the default is 300).")
        if self.timeout_s > MAX_TIMEOUT_S:
            raise ConfigError(f"launch.timeout_s = {self.timeout_s:g} is above the maximum of {MAX_TIMEOUT_S:g} s (7 days) "
                              f"that a collective may wait; set {MAX_TIMEOUT_S:g} or less (the default is 300).")


# Every #SBATCH line of the job script, whatever option it comes from, is checked in one place where it is written
# (slurm.sbatch_lines.sbatch_options): sbatch must read it as one option ('debug --job-name=X' ran the job as X).


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every_steps: int = 0
    """Write a snapshot every this many optimizer steps (0: not by steps)."""
    every_epochs: int = 1
    """Write a snapshot at the end of every this many epochs (0: not by epochs). The run's end always writes one."""
    keep_last: int = 2
    """Snapshots kept in runs/<name>/checkpoints; older ones are deleted after a newer one is complete."""
    async_save: bool = False
    """Write the shards in the background (after a copy to CPU memory) while training goes on."""

    def __post_init__(self) -> None:
        not_negative(self.every_steps, "checkpoint.every_steps")
        not_negative(self.every_epochs, "checkpoint.every_epochs")
        positive(self.keep_last, "checkpoint.keep_last")


# A run name is one folder's name, a job's name and a word in log lines: no path separator, no '..', no control
# character or escape that could forge a log line, no comma (TensorBoard's --logdir_spec splits on commas), and
# never an option (a leading '-').
MAX_RUN_NAME_CHARS = 100
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=@-]{0,%d}" % (MAX_RUN_NAME_CHARS - 1))


@dataclass(frozen=True, kw_only=True)
class OutputConfig:
    name: str = field(default="run", metadata={**MAY_CHANGE_AT_RESUME, SHOWN_DEFAULT: "DATA_MODEL_STRATEGY[_HASH]"})
    """Run name; the run folder is runs/<name> unless output.dir is set. Up to 100 letters, digits and ._-+=@,
    starting with a letter, digit or _ (a folder elsewhere is output.dir). Given neither, train, config, submit and
    doctor name the run after what makes it another run: data.name, model.name and strategy.name
    (fashion-mnist_mnist-cnn_ddp), then, where another option a resume must keep differs from its default, 8 hex
    digits of a hash of those options; so the same command resumes in its folder and a new experiment starts afresh
    in another. A runs/run of an earlier dptrain holding the same experiment is resumed there."""
    dir: str | None = may_change_at_resume(None)
    """Run folder (None: runs/<name>): a new or empty folder, or an earlier run's; a folder that holds other files
    but none of a run's (/etc, a project's folder) is refused, as it is no run's to write into."""
    weights_dir: str | None = may_change_at_resume(None)
    """Folder the final weights are saved in (None: the run folder), made if missing; a relative path is from
    the current folder, as output.dir's. The tutorials' --model_dir."""
    weights_file: str = may_change_at_resume("model.pt")
    """Name of the final weights' file in output.weights_dir: the whole model's state_dict, for plain torch.load
    (written by rank 0 at the run's end, replaced atomically). It may replace earlier final weights only: a name of the run
    folder's own (config.toml, checkpoints, ...) or a file of other content is refused before the run starts. The
    tutorials' --model_filename."""
    trackers: tuple[TrackerName, ...] = may_change_at_resume(())
    """Experiment trackers that rank 0 sends the run to beside TensorBoard, each installed by name (pip install
    'dptrain[mlflow]'): mlflow, wandb, or both (mlflow,wandb). What metrics.jsonl holds goes there: the configuration as
    parameters, each step's loss and rate, each epoch's metrics, and the final weights as an artifact. They run on a
    thread of their own, so that training never waits for them; one that fails says so in one warning line, and the
    run goes on without it."""
    mlflow_uri: str | None = may_change_at_resume(None)
    """MLflow's tracking URI, a server's (http://HOST:5000) or a database's (sqlite:///PATH); None: an SQLite store
    in the run folder, mlflow/ (mlflow.db and the artifacts), with no server. The experiment is MLFLOW_EXPERIMENT_NAME,
    else dptrain; the run is named after the run folder."""
    wandb_mode: Literal["offline", "online"] = may_change_at_resume("offline")
    """Weights & Biases: offline writes the run into the run folder's wandb/ only, with no network and no login
    (`wandb sync` uploads it later); online sends it as it goes (after `wandb login`). The project is WANDB_PROJECT,
    else dptrain."""
    rank_epoch_lines: bool = may_change_at_resume(False)
    """Every rank prints its own epoch line (`rank 1 epoch 2: 469 steps, ...`) on the console and in the job's
    output, as the tutorials' print in every process does; otherwise other ranks' lines go to logs/rank<R>.log only."""

    def __post_init__(self) -> None:
        if not RUN_NAME.fullmatch(self.name):
            raise ConfigError(f"output.name = {shown(self.name)} is not a run name; use up to 100 letters, digits and "
                              f"._-+=@, starting with a letter, digit or _ (to put the run in another folder, give "
                              f"--output.dir).")
        if self.dir is not None and not self.dir.isprintable():
            raise ConfigError(f"output.dir = {shown(self.dir)} holds a control character (a line break, an escape) or "
                              f"bytes that are not UTF-8 text; give a folder whose path is printable text.")
        if self.mlflow_uri is not None and (not self.mlflow_uri.isprintable() or not self.mlflow_uri.strip()):
            raise ConfigError(f"output.mlflow_uri = {shown(self.mlflow_uri)} is not a URI; give one such as "
                              f"http://HOST:5000 or sqlite:///PATH, or leave it out for a store in the run folder.")
        if self.weights_dir is not None and not self.weights_dir.isprintable():
            raise ConfigError(f"output.weights_dir = {shown(self.weights_dir)} holds a control character (a line break, "
                              f"an escape) or bytes that are not UTF-8 text; give a folder whose path is printable text.")
        if self.weights_file in ("", ".", "..") or Path(self.weights_file).name != self.weights_file \
                or not self.weights_file.isprintable():  # a folder goes in output.weights_dir, not in the name
            raise ConfigError(f"output.weights_file = {shown(self.weights_file)} is not a file name; give a name such as "
                              f"model.pt, and the folder as output.weights_dir.")

    @property
    def run_dir(self) -> Path:
        return Path(self.dir) if self.dir else Path("runs") / self.name

    @property
    def weights(self) -> Path:
        """The final weights' file: output.weights_file in output.weights_dir, or in the run folder."""
        return (Path(self.weights_dir) if self.weights_dir else self.run_dir) / self.weights_file

    @property
    def folder(self) -> RunFolder:
        """The run folder's files and folders by name, its final weights where output.weights_* put them."""
        return RunFolder(self.run_dir, weights=self.weights)

    @property
    def elsewhere(self) -> str:
        """The option that starts a run afresh in another run folder, as this one was given: a folder given by
        output.dir overrides output.name, so another name would not move it (advice ends with it)."""
        return "another --output.dir" if self.dir else "another --output.name"


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata=MAY_CHANGE_AT_RESUME)
    output: OutputConfig = field(default_factory=OutputConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig, metadata=MAY_CHANGE_AT_RESUME)

    def __post_init__(self) -> None:
        if self.train.cuda_graph and self.optim.name == "sgd":
            raise ConfigError("train.cuda_graph needs optim.name adam or adamw (their fused, capturable step reads the "
                              "learning rate from the GPU); use one of them, or drop train.cuda_graph.")
        if self.train.compile and self.train.cuda_graph:
            raise ConfigError("train.compile and train.cuda_graph are two ways to cut kernel launches and do not "
                              "combine; keep one of them.")
        if self.train.compile and self.strategy.spec.compile_refusal:
            raise ConfigError(self.strategy.spec.compile_refusal)
        if self.train.fp16 and self.train.bf16:
            raise ConfigError("train.fp16 and train.bf16 are two precisions of the same autocast; keep one of them.")
        if self.train.fp16 and self.train.cuda_graph:
            raise ConfigError("train.cuda_graph replays a captured step, and train.fp16's loss scaler decides on the "
                              "host, each step, whether to skip its update; drop one of the two.")
        if self.train.cuda_graph and self.train.accumulate_steps > 1:
            raise ConfigError(f"train.cuda_graph captures one forward and backward a step, and train.accumulate_steps "
                              f"{self.train.accumulate_steps} runs {self.train.accumulate_steps}; drop one of the two.")
        if self.train.cuda_graph and self.optim.schedule == "onecycle":
            raise ConfigError("train.cuda_graph cannot follow optim.schedule onecycle, which changes Adam's betas every "
                              "step; use cosine, or drop train.cuda_graph.")
        self._check_float_ranges()

    def _check_float_ranges(self) -> None:
        """Every float option, and the peak rate scaled from optim.lr, within FLOAT32_MAX's range; after the sections'
        own checks, whose sentences say more (a timeout's week, a rate's sign)."""
        for name, value in _float_values(self):
            beyond = _beyond_float32(value)
            if beyond:
                advice = "a smaller value" if abs(value) > 1 else "a larger value (or 0, where 0 is allowed)"
                raise ConfigError(f"{name} = {value} is {beyond}, and the training's tensors hold 32-bit floats; give "
                                  f"{advice}.")
        peak = self.optim.peak_lr(self.train.global_batch_size)
        beyond = _beyond_float32(peak)
        if beyond:
            raise ConfigError(f"optim.lr = {self.optim.lr} scaled by optim.scale_lr_with {self.optim.scale_lr_with} to "
                              f"train.global_batch_size {self.train.global_batch_size} is a peak rate of {peak:.3g}, "
                              f"{beyond}; give a {'smaller' if peak > 1 else 'larger'} optim.lr.")


def _beyond_float32(value: float) -> str:
    """How value lies beyond 32-bit floats' range, in words; empty where it is within (0 is)."""
    if value > FLOAT32_MAX:
        return f"above {FLOAT32_MAX:.3g}, the largest 32-bit float"
    if value < -FLOAT32_MAX:
        return f"below {-FLOAT32_MAX:.3g}, the lowest 32-bit float"
    if value and abs(value) < FLOAT32_TINY:
        return f"closer to 0 than {FLOAT32_TINY:.2g}, the smallest normal 32-bit float"
    return ""


def _float_values(cfg: RunConfig) -> Iterator[tuple[str, float]]:
    """(dotted name, value) of every number a float option holds (each of a list's, such as optim.betas)."""
    for name in _float_options():
        value: Any = cfg
        for part in name.split("."):
            value = getattr(value, part)
        for number in value if isinstance(value, tuple) else (value,):
            if number is not None:
                yield name, number


@functools.cache
def _float_options() -> tuple[str, ...]:
    """The dotted names of the options declared float, float | None or a tuple of floats, tables' included."""
    def walk(cls: type, prefix: str) -> Iterator[str]:
        for name, tp in field_types(cls).items():
            if is_table(tp):
                yield from walk(tp, f"{prefix}.{name}")
            elif float in (tp, *typing.get_args(tp)):
                yield f"{prefix}.{name}"

    return tuple(name for section, cls in field_types(RunConfig).items() for name in walk(cls, section))
