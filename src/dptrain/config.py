"""RunConfig: one typed tree of dataclasses, loaded from TOML and dotted CLI overrides.

Every section is a frozen dataclass whose field docstrings are the reference for the option
of the same dotted name (`--optim.lr 3e-4` sets `OptimConfig.lr`); `options()` reads them for
`dptrain train --help`. Checks of one value against its declared type (a `Literal`'s members, a
float's finiteness) live in `_coerce`, which every TOML value and CLI string passes through;
checks of a value's range, or of several options together, live in `__post_init__`; checks that
need the world size, the dataset size or the torch version live with the strategies
(`dptrain.strategies.check_world()`), which the launcher calls before any worker starts.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import logging
import math
import re
import shlex
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator, Literal

from dptrain import read_back
from dptrain.errors import ConfigError
from dptrain.run_folder import RunFolder

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def _choice(value: Any, name: str, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} = {value!r} is not one of {', '.join(map(str, choices))}; pick one of them.")


def _name_or_import_path(value: str, name: str, choices: tuple[str, ...]) -> None:
    """A built-in name, or a user's `package.module:Name` (imported, and so checked, by preflight)."""
    if not is_import_path(value) and value not in choices:
        raise ConfigError(f"{name} = {value!r} is not one of {', '.join(choices)}, nor an import path "
                          f"package.module:Name; pick one of them or give an import path.")


def _positive(value: float, name: str) -> None:
    if value <= 0:
        raise ConfigError(f"{name} = {value} must be greater than 0.")


def _not_negative(value: float, name: str) -> None:
    if value < 0:
        raise ConfigError(f"{name} = {value} must be 0 or more.")


def _shown(text: str, limit: int = 60) -> str:
    """A user's text in an error message: quoted and escaped (no line breaks or escapes reach the console), cut short."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def _key_shown(key: str) -> str:
    """A file's key in an error message: as it is where printable and short, else as _shown gives it (a quoted TOML
    key may hold any character)."""
    return key if key.isprintable() and len(key) <= 60 else _shown(key)


MAY_CHANGE_AT_RESUME = {"may_change_at_resume": True}
"""A field's metadata: the option may change between a snapshot and its resume (how long to run, where data and logs
live, how often to save, how evaluation is batched, which device). Every other option changes the computation, so a
resume refuses it (checkpoint.check_compatible); the world size may change too (the shards are resharded on load)."""


REFUSED_ELSEWHERE = {"refused_elsewhere": True}
"""A strategy option's metadata: set (to other than its default) with a strategy its table does not apply to, the run is
refused, since the user expects an effect that would not come (a comm hook with fsdp, a ZeRO stage with ddp)."""


def may_change_at_resume(default: Any) -> Any:
    """A field of that default whose option may change at resume."""
    return field(default=default, metadata=MAY_CHANGE_AT_RESUME)


DATASET_NAMES = ("fashion-mnist", "mnist", "cifar10", "synthetic")
MODEL_NAMES = ("mnist-cnn", "cifar-cnn", "resnet18")
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


def is_import_path(name: str) -> bool:
    """True for a user's `package.module:Name`."""
    return ":" in name


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
    augment: Literal["none", "crop-flip"] = "none"
    """Training augmentation on the device: none, or crop-flip (random crop of the 4-pixel zero-padded image,
    then a horizontal flip half the time; each draw a function of train.seed, epoch and sample index, so
    the same whatever the world size and after a resume). Evaluation never augments."""

    def __post_init__(self) -> None:
        _name_or_import_path(self.name, "data.name", DATASET_NAMES)
        _positive(self.synthetic_train_size, "data.synthetic_train_size")
        _positive(self.synthetic_test_size, "data.synthetic_test_size")
        if len(self.synthetic_shape) != 3 or min(self.synthetic_shape) <= 0:
            raise ConfigError(f"data.synthetic_shape = {list(self.synthetic_shape)} must be three positive sizes [C, H, W].")
        if self.synthetic_num_classes < 2:
            raise ConfigError(f"data.synthetic_num_classes = {self.synthetic_num_classes} must be at least 2.")
        _not_negative(self.num_workers, "data.num_workers")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = "mnist-cnn"
    """mnist-cnn, cifar-cnn, resnet18, or `package.module:ClassName` (constructed with no arguments)."""
    dropout: bool = True
    """False replaces every nn.Dropout by identity (for exact cross-world-size comparisons)."""

    def __post_init__(self) -> None:
        _name_or_import_path(self.name, "model.name", MODEL_NAMES)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    name: Literal["sgd", "adam", "adamw"] = "adam"
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
        _positive(self.lr, "optim.lr")
        _not_negative(self.warmup_steps, "optim.warmup_steps")
        _positive(self.reference_batch_size, "optim.reference_batch_size")
        _not_negative(self.momentum, "optim.momentum")
        _not_negative(self.weight_decay, "optim.weight_decay")
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise ConfigError(f"optim.betas = {list(self.betas)} must be two numbers from 0 up to (not including) 1, "
                              f"like 0.9,0.999.")
        _positive(self.eps, "optim.eps")
        _positive(self.step_epochs, "optim.step_epochs")
        _positive(self.gamma, "optim.gamma")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    epochs: int = may_change_at_resume(2)
    """Passes over the training split."""
    max_steps: int | None = may_change_at_resume(None)
    """Stop after this many optimizer steps, even mid-epoch (None: run all epochs)."""
    global_batch_size: int = 128
    """Samples per optimizer step over all ranks; each rank takes global_batch_size / world_size."""
    batch_size_per_rank: int | None = may_change_at_resume(None)
    """The tutorials' batch instead: samples per step on each rank that takes data. The global batch is then this
    times those ranks, printed and saved as train.global_batch_size: it changes with the world size, and with it what
    a step computes (a resume at another world size is refused). None: train.global_batch_size decides."""
    eval_batch_size: int = may_change_at_resume(128)
    """Samples per evaluation forward pass on each rank. Small batches keep the activations in the CPU's caches:
    the tutorials' CNN evaluates 2.3x faster on one core at 128 than at 1000, and holds about 200 MB less."""
    seed: int = 0
    """Seeds the model init, the data order and every rank's RNG."""
    bf16: bool = False
    """Autocast the forward pass to bfloat16."""
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
    `python bench/speed.py`). Evaluation stays eager. Not with strategy dp or train.cuda_graph."""
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
    """auto: continue from the newest valid snapshot in the run directory; never; or a snapshot folder."""
    eval_every_epochs: int = may_change_at_resume(1)
    """Evaluate on the test split after every this many epochs (0: only at the end); the run's last epoch, or the
    partial epoch a train.max_steps stop ends in, is always evaluated."""

    def total_steps(self, steps_per_epoch: int) -> int:
        """The run's optimizer steps: every epoch's, cut at max_steps."""
        total = self.epochs * steps_per_epoch
        return total if self.max_steps is None else min(total, self.max_steps)

    def __post_init__(self) -> None:
        _positive(self.epochs, "train.epochs")
        _not_negative(self.eval_every_epochs, "train.eval_every_epochs")
        if self.max_steps is not None:
            _positive(self.max_steps, "train.max_steps")
        _positive(self.global_batch_size, "train.global_batch_size")
        if self.batch_size_per_rank is not None:
            _positive(self.batch_size_per_rank, "train.batch_size_per_rank")
        _positive(self.eval_batch_size, "train.eval_batch_size")
        _positive(self.log_every, "train.log_every")
        _not_negative(self.progress_every_s, "train.progress_every_s")
        if self.grad_clip is not None:
            _positive(self.grad_clip, "train.grad_clip")


StrategyName = Literal["ddp", "fsdp", "zero1", "ps", "dp", "single", "deepspeed"]
"""strategies.STRATEGIES' names (a test pins the two together: that table imports torch, this module must not)."""
CommHook = Literal["allreduce", "fp16", "bf16", "powersgd", "ring"]
"""strategies.comm_hooks' hooks, and allreduce (none: DDP's own); pinned to them by a test."""
FloatDtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(frozen=True, kw_only=True)
class DDPOptions:
    """[strategy.ddp]: how ddp and zero1 (DDP with a sharded optimizer) send their gradients."""

    applies_to: ClassVar[tuple[str, ...]] = ("ddp", "zero1")
    comm_hook: CommHook = field(default="allreduce", metadata=REFUSED_ELSEWHERE)
    """Gradient communication: allreduce, fp16 or bf16 compression, powersgd, or ring (hand-written)."""
    shared_memory: bool = True
    """With comm_hook allreduce, on CPU ranks that all run on one host: sum the gradients through a buffer in /dev/shm
    instead of gloo's TCP loopback (the same sum; a tenth of the time for the tutorials' CNN). Where it cannot be set
    up, gloo's all-reduce, with one log line saying why. On several hosts with several ranks a host: within each host
    through it, then across hosts by one rank a host (less traffic on each host's link)."""
    powersgd_rank: int = 4
    """Rank of PowerSGD's low-rank approximation (higher: closer to exact, more traffic)."""
    bucket_mb: float | None = may_change_at_resume(None)
    """The most MiB of gradients DDP sends in one message; backward's later layers wait less with smaller buckets, a
    slow link more with many small ones. None: one bucket for the shared-memory sum on one host (it overlaps
    nothing), else DDP's own (25 MiB, its first 1 MiB). `dptrain bench --tune` tries a few."""

    def __post_init__(self) -> None:
        _positive(self.powersgd_rank, "strategy.ddp.powersgd_rank")
        if self.bucket_mb is not None:
            _positive(self.bucket_mb, "strategy.ddp.bucket_mb")


@dataclass(frozen=True, kw_only=True)
class FSDPOptions:
    """[strategy.fsdp]: FSDP2's resharding and mixed precision."""

    applies_to: ClassVar[tuple[str, ...]] = ("fsdp",)
    reshard_after_forward: bool = True
    """true frees gathered parameters after forward (ZeRO-3 / FULL_SHARD), false keeps them (ZeRO-2)."""
    param_dtype: FloatDtype = "auto"
    """Mixed precision: dtype of the gathered parameters used in forward and backward (auto: the parameters' own)."""
    reduce_dtype: FloatDtype = "auto"
    """Mixed precision: dtype of the gradient reduce-scatter (auto: the parameters' own)."""
    wrap: Literal["block", "size", "whole"] = may_change_at_resume("block")
    """How the model is cut into units that gather and free their parameters together: block (each child of the root
    that holds parameters, a ResNet stage's blocks one by one), size (the innermost modules holding wrap_min_params
    parameters or more, as torch's size-based policy), whole (one unit: the fewest collectives, the least memory
    saved). The sums are the same: a snapshot resumes under another wrap."""
    wrap_min_params: int = may_change_at_resume(100_000)
    """With wrap size: the parameters a unit holds at least (those of its submodules not wrapped already)."""

    def __post_init__(self) -> None:
        _positive(self.wrap_min_params, "strategy.fsdp.wrap_min_params")


@dataclass(frozen=True, kw_only=True)
class DPOptions:
    """[strategy.dp]: the GPUs nn.DataParallel drives."""

    applies_to: ClassVar[tuple[str, ...]] = ("dp",)
    devices: tuple[int, ...] = field(default=(), metadata={**MAY_CHANGE_AT_RESUME, **REFUSED_ELSEWHERE})
    """GPU indices as torch numbers the visible ones (after CUDA_VISIBLE_DEVICES), e.g. 0,1; the first holds the model,
    the optimizer and the gathered outputs. Empty: every visible GPU. The sums are the same on any set."""

    def __post_init__(self) -> None:
        if any(index < 0 for index in self.devices):
            raise ConfigError(f"strategy.dp.devices = {list(self.devices)} holds a negative index; GPUs are numbered "
                              f"from 0, e.g. --strategy.dp.devices 0,1.")
        if len(set(self.devices)) != len(self.devices):
            raise ConfigError(f"strategy.dp.devices = {list(self.devices)} names a GPU twice; name each once.")


@dataclass(frozen=True, kw_only=True)
class PSOptions:
    """[strategy.ps]: the parameter server's roles."""

    applies_to: ClassVar[tuple[str, ...]] = ("ps",)
    dedicated_server: bool = False
    """Rank 0 only serves (the data is split across ranks 1..N-1) instead of also training."""


@dataclass(frozen=True, kw_only=True)
class DeepSpeedOptions:
    """[strategy.deepspeed]: DeepSpeed's ZeRO stage and its own settings."""

    applies_to: ClassVar[tuple[str, ...]] = ("deepspeed",)
    zero_stage: int = field(default=2, metadata=REFUSED_ELSEWHERE)
    """ZeRO stage, 1, 2 or 3; 1 shards the optimizer state over the ranks, 2 the gradients too, 3 the parameters too."""
    config: str | None = field(default=None, metadata={**MAY_CHANGE_AT_RESUME, **REFUSED_ELSEWHERE})
    """A DeepSpeed JSON file (ds_config.json) for the engine's own settings, such as ZeRO's buckets and communication
    (None: DeepSpeed's defaults). The batch, optimizer, schedule, clipping, precision and ZeRO stage stay dptrain's
    options: the file may repeat them, and a run that it contradicts is refused. A resume may name another file that
    says the same: what it says is part of the snapshot's configuration."""

    def __post_init__(self) -> None:
        if self.zero_stage not in (1, 2, 3):
            raise ConfigError(f"strategy.deepspeed.zero_stage = {self.zero_stage} is not a ZeRO stage that strategy "
                              f"deepspeed runs; pick 1, 2 or 3.")


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    name: StrategyName = "ddp"
    """ddp, fsdp (FSDP2), zero1 (DDP + sharded optimizer state), ps (parameter server),
    dp (nn.DataParallel, one process), single (one process, one device), deepspeed (DeepSpeed's ZeRO engine;
    pip install 'dptrain[deepspeed]')."""
    ddp: DDPOptions = field(default_factory=DDPOptions)
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    dp: DPOptions = field(default_factory=DPOptions)
    ps: PSOptions = field(default_factory=PSOptions)
    deepspeed: DeepSpeedOptions = field(default_factory=DeepSpeedOptions)

    def __post_init__(self) -> None:
        # A table's options belong to the strategies it applies to; set for another strategy, those marked
        # REFUSED_ELSEWHERE are refused (the others are left unread, so that one config serves a sweep of strategies).
        for table, options in self.tables().items():
            if self.name in options.applies_to:
                continue
            for f in dataclasses.fields(options):
                value = getattr(options, f.name)
                if f.metadata.get("refused_elsewhere") and value != f.default:
                    who = " and ".join(options.applies_to)
                    who = f"strategy {who}" if len(options.applies_to) == 1 else who
                    raise ConfigError(f"strategy.{table}.{f.name} {value} applies to {who} only, not {self.name}; "
                                      f"drop it or use --strategy.name {options.applies_to[0]}.")

    def tables(self) -> dict[str, Any]:
        """Table name -> its options, for every strategy that has options of its own."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name"}


# The flat keys of [strategy] before each strategy had its table (strategy.comm_hook, ...): read for one release, each
# moved to its table's key with one log line.
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
    GPU (as the tutorials' world_size = torch.cuda.device_count()), one on a machine without (it uses every core)."""
    device: Literal["auto", "cpu", "cuda"] = may_change_at_resume("auto")
    """auto: cuda:<local_rank> when CUDA is available, else cpu."""
    backend: Literal["auto", "nccl", "gloo"] = may_change_at_resume("auto")
    """Collective backend: auto is nccl on GPUs and gloo on the CPU; gloo on GPUs is the fallback to try when nccl
    misbehaves (slower: it stages tensors through host memory for some collectives)."""
    timeout_s: float = may_change_at_resume(300.0)
    """Seconds (1 to 604800, a week) bounding rendezvous and any collective; a missing peer fails the run after this."""
    max_restarts: int = may_change_at_resume(0)
    """Times the elastic agent restarts the local workers after one fails; each restart resumes from the newest snapshot."""

    def __post_init__(self) -> None:
        if self.nproc_per_node != "auto":
            _positive(self.nproc_per_node, "launch.nproc_per_node")
        _not_negative(self.max_restarts, "launch.max_restarts")
        if self.timeout_s < MIN_TIMEOUT_S:
            raise ConfigError(f"launch.timeout_s = {self.timeout_s:g} is below the minimum of {MIN_TIMEOUT_S:g} s: it bounds "
                              f"the rendezvous and every collective, and starting the workers alone takes longer than that; "
                              f"set {MIN_TIMEOUT_S:g} or more (the default is 300).")
        if self.timeout_s > MAX_TIMEOUT_S:
            raise ConfigError(f"launch.timeout_s = {self.timeout_s:g} is above the maximum of {MAX_TIMEOUT_S:g} s (7 days) "
                              f"that a collective may wait; set {MAX_TIMEOUT_S:g} or less (the default is 300).")


# Every #SBATCH line of the job script, whatever option it comes from, is checked in one place where it is written
# (slurm.job.sbatch_options): sbatch must read it as one option ('debug --job-name=X' ran the job as X).
SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}")  # sbatch --time: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
# The sbatch options that ask for GPUs, as the tutorials' job scripts write them (#SBATCH --gres=gpu:4), -> what their
# count is per: a node, the whole job (-G is --gpus), or a task. slurm.sbatch lines holding one make the job a GPU job.
GPU_SBATCH_OPTIONS = {"gres": "node", "gpus-per-node": "node", "gpus": "job", "G": "job", "gpus-per-task": "task"}
GPU_FORMS = "--gres=gpu:N, --gres=gpu:TYPE:N, --gpus-per-node=N, --gpus=N or --gpus-per-task=N"


@dataclass(frozen=True)
class SbatchGpus:
    """One sbatch option of slurm.sbatch that asks for GPUs: as written (--gres=gpu:a100:4), its count, what per."""

    written: str
    count: int
    per: Literal["node", "job", "task"]


def sbatch_gpus(lines: tuple[str, ...]) -> list[SbatchGpus]:
    """The GPU requests in slurm.sbatch's lines ('gres=gpu:4', '--gpus 8', '-G 8', 'gpus-per-task=1 --exclusive'),
    read as sbatch reads an #SBATCH line: options and their values; ConfigError in one sentence for one it cannot count."""
    found = []
    for line in lines:
        try:
            words = shlex.split(line)
        except ValueError:  # an unbalanced quote: sbatch would refuse the line; its GPU options are still counted
            words = line.split()
        if words and not words[0].startswith("-"):
            words[0] = "--" + words[0]  # written so in the script (render adds the --)
        at = 0
        while at < len(words):
            word, at = words[at], at + 1
            if word.startswith("--"):
                name, sep, value = word[2:].partition("=")
            elif word.startswith("-G"):  # -G 8, -G8
                name = "G"
                sep = value = word[2:].removeprefix("=")
            else:
                continue
            if name not in GPU_SBATCH_OPTIONS:
                continue
            if not sep and at < len(words):  # --gres gpu:4: the value is the next word
                value, at = words[at], at + 1
            written = f"-G {value}" if name == "G" else f"--{name}={value}"
            count = (_gres_gpus(value) if name == "gres" else _typed_counts(value)) if value else None
            if count is None:
                raise ConfigError(f"slurm.sbatch asks for GPUs as {_shown(written)}, which dptrain cannot count; write it "
                                  f"as {GPU_FORMS}.")
            found.append(SbatchGpus(written, count, GPU_SBATCH_OPTIONS[name]))  # type: ignore[arg-type]
    return found


def _gres_gpus(value: str) -> int | None:
    """GPUs in a --gres request ('gpu:4', 'gpu:a100:2,nvme:1', 'gpu' for one; 'none'); None where a count is unreadable."""
    total = 0
    for item in value.split(","):
        name, *rest = item.removeprefix("gres/").split(":")
        if name != "gpu":
            continue
        if not rest or (len(rest) == 1 and not rest[0].isdigit()):  # gpu, gpu:a100: one GPU (of that type)
            total += 1
        elif rest[-1].isdigit() and len(rest) <= 2:
            total += int(rest[-1])
        else:
            return None
    return total


def _typed_counts(value: str) -> int | None:
    """The GPUs of --gpus, --gpus-per-node or --gpus-per-task ('4', 'a100:4', 'a100:2,v100:2'); None where unreadable."""
    counts = [item.split(":")[-1] for item in value.split(",")]
    if not all(c.isdigit() for c in counts) or any(len(item.split(":")) > 2 for item in value.split(",")):
        return None
    return sum(map(int, counts))


@dataclass(frozen=True, kw_only=True)
class SlurmConfig:
    """The job `dptrain submit` writes and submits (sbatch's own option names, with _ for -)."""

    nodes: int = 1
    """Nodes of the job."""
    gpus_per_node: int = 0
    """GPUs per node (0: a CPU job on gloo)."""
    cpus_per_node: int = 0
    """CPU cores per node the job asks for (0: the partition's default); each rank gets its share as threads."""
    ranks_per_node: int | Literal["auto"] = "auto"
    """Ranks (training processes) per node; auto: one per GPU, or one on a CPU job (it uses every core asked for)."""
    mode: Literal["per-rank", "agent"] = "per-rank"
    """per-rank: one srun task per rank, placed by SLURM; agent: one srun task per node running torch's elastic
    agent, which starts that node's ranks (rendezvous on the first node; launch.max_restarts applies)."""
    time: str | None = None
    """Time limit, as sbatch takes it (02:00:00, 1-12:00:00, ...; none: the partition's default)."""
    partition: str | None = None
    """Partition (none: the cluster's default)."""
    account: str | None = None
    """Account charged for the job."""
    qos: str | None = None
    """Quality of service."""
    constraint: str | None = None
    """Node features the job needs (sbatch --constraint)."""
    mem: str | None = None
    """Memory per node (sbatch --mem, e.g. 32G)."""
    exclusive: bool = False
    """Ask for whole nodes, shared with no other job."""
    signal_lead_s: int = 120
    """Seconds before the time limit at which SLURM sends SIGUSR1: the ranks write a snapshot at their next step
    boundary and stop (0: no signal; the job then loses the steps since its last periodic snapshot)."""
    requeue: bool = False
    """After that signal's snapshot, rank 0 requeues the job (scontrol requeue); the rerun resumes from the snapshot.
    Also lets SLURM requeue the job after a preemption or a node failure."""
    master_addr: str | None = None
    """Address the ranks reach the first node by (none: its NodeAddr from scontrol; set it to use another network,
    e.g. the name of its InfiniBand interface)."""
    setup: tuple[str, ...] = ()
    """Shell lines run before training, e.g. ["module load pytorch", "source ~/venv/bin/activate"]."""
    sbatch: tuple[str, ...] = ()
    """Extra #SBATCH lines, e.g. ["--mail-type=END", "--reservation=course"]."""
    python: str | None = None
    """The Python that runs dptrain in the job (none: the one running `dptrain submit`; with setup lines that
    activate an environment, or in a container, python: the first on the PATH there)."""
    container_image: str | None = None
    """Run the ranks inside this container image (none: on the nodes as they are), started by
    slurm.container_engine: a registry image (pyxis: nvcr.io#nvidia/pytorch:25.01-py3; apptainer:
    docker://nvcr.io/nvidia/pytorch:25.01-py3) or an image file (pyxis: a .sqsh squashfs; apptainer: a .sif), which
    must exist. The folder dptrain submit runs in and the run directory are mounted at their own paths, and the ranks
    start in that folder; the image's python (see slurm.python) runs dptrain and needs torch."""
    container_env_file: str | None = None
    """Run the ranks in the container that this environment definition file describes instead (srun
    --environment=FILE, the pyxis/enroot Container Engine of clusters such as CSCS's): a .toml file, which must
    exist, or the name of one in ~/.edf. The file names the image, its mounts (which must hold the folder dptrain
    submit runs in and the run directory) and its workdir; give it or slurm.container_image, not both."""
    container_engine: Literal["pyxis", "apptainer"] = "pyxis"
    """What starts slurm.container_image: pyxis (srun --container-image, with enroot) or apptainer (apptainer exec
    under srun, with --nv on a GPU job)."""

    def __post_init__(self) -> None:
        _positive(self.nodes, "slurm.nodes")
        _not_negative(self.gpus_per_node, "slurm.gpus_per_node")
        _not_negative(self.cpus_per_node, "slurm.cpus_per_node")
        _not_negative(self.signal_lead_s, "slurm.signal_lead_s")
        if self.ranks_per_node != "auto":
            _positive(self.ranks_per_node, "slurm.ranks_per_node")
        gpus = self.gpus_here  # the sbatch lines' GPU requests, checked here: one sentence before anything is written
        if self.gpus_per_node and gpus != self.gpus_per_node:
            written = self.sbatch_gpus_per_node()[0]  # type: ignore[index]  # gpus differs: a line asks for them
            raise ConfigError(f"slurm.gpus_per_node = {self.gpus_per_node} but slurm.sbatch's {written} asks for "
                              f"{gpus} per node; ask for the GPUs once, as --gpus-per-node N or as an --sbatch line.")
        ranks = self.ranks_here
        if self.cpus_per_node and ranks > self.cpus_per_node:
            raise ConfigError(f"slurm.ranks_per_node = {ranks} is more than slurm.cpus_per_node = {self.cpus_per_node}; "
                              f"give every rank a core at least.")
        if self.master_addr is not None and any(c.isspace() or not c.isprintable() for c in self.master_addr):
            raise ConfigError(f"slurm.master_addr = {_shown(self.master_addr)} holds a space or control character; give "
                              f"one host name or address.")
        if self.time is not None and not SLURM_TIME.fullmatch(self.time):
            raise ConfigError(f"slurm.time = {self.time!r} is not a time sbatch reads; write it as HH:MM:SS or D-HH:MM:SS.")
        if self.requeue and not self.signal_lead_s:
            raise ConfigError("slurm.requeue needs slurm.signal_lead_s above 0: the signal is what makes the ranks write "
                              "the snapshot the rerun resumes from.")
        for name, lines in {"setup": self.setup, "sbatch": self.sbatch, "python": (self.python or "",)}.items():
            if any(not c.isprintable() and c != "\t" for line in lines for c in line):
                raise ConfigError(f"slurm.{name} holds a line break or another control character; give printable text, "
                                  f"one line per list item.")
        self._check_container()

    def _check_container(self) -> None:
        """The container options, as far as they can be checked alone and without the files (slurm.job.job_for checks
        the rest where the job is written: a rank reads this config too, where the files may not be)."""
        for name in ("container_image", "container_env_file"):
            value = getattr(self, name)
            if value is not None and (not value or any(c.isspace() or not c.isprintable() for c in value)):
                raise ConfigError(f"slurm.{name} = {_shown(value)} is empty or holds a space or control character, "
                                  f"which the srun line cannot carry; give an image name or a path without spaces.")
        if self.container_image and self.container_env_file:
            raise ConfigError("slurm.container_image and slurm.container_env_file are two ways to give the container "
                              "(the environment file names its own image); keep one of them.")
        if self.container_env_file and self.container_engine != "pyxis":
            raise ConfigError(f"slurm.container_env_file is read by srun --environment (pyxis), not by "
                              f"{self.container_engine}; give the image as slurm.container_image instead, or drop "
                              f"slurm.container_engine.")

    @property
    def container(self) -> str | None:
        """What runs the ranks: pyxis (an image), edf (an environment file), apptainer; None: no container."""
        if self.container_env_file:
            return "edf"
        return self.container_engine if self.container_image else None

    @property
    def ranks_here(self) -> int:
        """ranks_per_node resolved."""
        if self.ranks_per_node != "auto":
            return int(self.ranks_per_node)
        return self.gpus_here or 1

    @property
    def gpus_here(self) -> int:
        """GPUs per node: as an sbatch line asks for them (gres=gpu:4, ...), else gpus_per_node (the two agree)."""
        asked = self.sbatch_gpus_per_node()
        return asked[1] if asked else self.gpus_per_node

    def sbatch_gpus_per_node(self) -> tuple[str, int] | None:
        """(the first slurm.sbatch option asking for GPUs, as written; the GPUs per node they all ask for), None where
        none does. ConfigError in one sentence where they disagree, or a count cannot be made per node."""
        per_node: tuple[str, int] | None = None
        for asked in sbatch_gpus(self.sbatch):
            if asked.per == "node":
                count = asked.count
            elif asked.per == "job":  # sbatch may place them unevenly; dptrain starts the same ranks on every node
                if asked.count % self.nodes:
                    raise ConfigError(f"slurm.sbatch's {asked.written} asks for {asked.count} GPUs over "
                                      f"{self.nodes} nodes, which do not share them evenly; ask for a multiple of "
                                      f"{self.nodes}, or per node (--gpus-per-node N).")
                count = asked.count // self.nodes
            elif self.mode == "agent":  # one task per node: the agent, which starts that node's ranks
                count = asked.count
            elif self.ranks_per_node == "auto":  # auto is one rank per GPU: a circle, unless the ranks are given
                raise ConfigError(f"slurm.sbatch's {asked.written} gives each rank its GPUs, and the ranks per node "
                                  f"are auto (one per GPU); give --ranks-per-node N too, or ask per node "
                                  f"(--gpus-per-node N).")
            else:
                count = asked.count * int(self.ranks_per_node)
            if per_node is not None and count != per_node[1]:
                raise ConfigError(f"slurm.sbatch asks for {per_node[1]} GPUs per node ({per_node[0]}) and for {count} "
                                  f"({asked.written}); keep one of these lines.")
            per_node = per_node or (asked.written, count)
        return per_node


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
        _not_negative(self.every_steps, "checkpoint.every_steps")
        _not_negative(self.every_epochs, "checkpoint.every_epochs")
        _positive(self.keep_last, "checkpoint.keep_last")


# A run name is one folder's name, a job's name and a word in log lines: no path separator, no '..', no control
# character or escape that could forge a log line, no comma (TensorBoard's --logdir_spec splits on commas), and
# never an option (a leading '-').
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=@-]{0,99}")


@dataclass(frozen=True, kw_only=True)
class OutputConfig:
    name: str = may_change_at_resume("run")
    """Run name; the run directory is runs/<name> unless output.dir is set. Up to 100 letters, digits and ._-+=@,
    starting with a letter, digit or _ (a folder elsewhere is output.dir)."""
    dir: str | None = may_change_at_resume(None)
    """Run directory (None: runs/<name>)."""

    def __post_init__(self) -> None:
        if not RUN_NAME.fullmatch(self.name):
            raise ConfigError(f"output.name = {_shown(self.name)} is not a run name; use up to 100 letters, digits and "
                              f"._-+=@, starting with a letter, digit or _ (to put the run in another folder, give "
                              f"--output.dir).")
        if self.dir is not None and not self.dir.isprintable():
            raise ConfigError(f"output.dir = {_shown(self.dir)} holds a control character (a line break, an escape) or "
                              f"bytes that are not UTF-8 text; give a folder whose path is printable text.")

    @property
    def run_dir(self) -> Path:
        return Path(self.dir) if self.dir else Path("runs") / self.name

    @property
    def folder(self) -> RunFolder:
        """The run directory's files and folders by name."""
        return RunFolder(self.run_dir)


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
        if self.train.compile and self.strategy.name == "dp":
            raise ConfigError("train.compile cannot compile through nn.DataParallel's per-step replication; use "
                              "--strategy.name ddp (one process per GPU), or drop train.compile.")
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
        for name, tp in _field_types(cls).items():
            if _is_table(tp):
                yield from walk(tp, f"{prefix}.{name}")
            elif float in (tp, *typing.get_args(tp)):
                yield f"{prefix}.{name}"

    return tuple(name for section, cls in _field_types(RunConfig).items() for name in walk(cls, section))


# ---------------------------------------------------------------- building from dicts and strings


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Check or convert a TOML value or CLI string to the field's declared type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        refusals = []
        for member in inner:  # the first type that takes the value, in the order declared
            try:
                return _coerce(value, member, name)
            except ConfigError as exc:
                refusals.append(exc)
        if len(inner) == 1:
            raise refusals[0]
        raise ConfigError(f"{name} expects {' or '.join(map(_type_words, inner))}, got {value!r}.")
    if origin is Literal:
        value = _coerce(value, type(args[0]), name)
        _choice(value, name, args)
        return value
    if origin is tuple:
        items = value
        if isinstance(value, str) and args[0] is str:  # a list of lines: a string on the command line is one line
            items = [value] if value.strip() not in ("", "[]") else []
        elif isinstance(value, str):
            items = [v for v in value.strip("[]()").replace(",", " ").split() if v]
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{name} expects a list like [1, 28, 28], got {value!r}.")
        return tuple(_coerce(v, args[0], name) for v in items)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{name} expects true or false, got {value!r}.")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name} expects an integer, got {value!r}.")
        try:
            return int(value) if isinstance(value, int) else int(str(value), 0)
        except ValueError:
            raise ConfigError(f"{name} expects an integer, got {value!r}.") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name} expects a number, got {value!r}.")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} expects a number, got {value!r}.") from None
        if not math.isfinite(number):  # nan passes every `<=` check; 1e400 reads as inf
            reads_as = "" if str(value).strip().lower() == str(number) else f" (it reads as {number})"
            raise ConfigError(f"{name} = {value}{reads_as} is not a finite number; give a finite value.")
        return number
    if tp is str:
        return str(value)
    raise AssertionError(f"unsupported config type {tp} for {name}")


def _type_words(tp: Any) -> str:
    """How an error message names a type: 'an integer', 'auto'."""
    if typing.get_origin(tp) is Literal:
        return " or ".join(map(str, typing.get_args(tp)))
    return {int: "an integer", float: "a number", bool: "true or false", str: "text"}.get(tp, str(tp))


def _is_table(tp: Any) -> bool:
    """A field holding a table of options of its own ([strategy.ddp])."""
    return dataclasses.is_dataclass(tp)


def _build_section(cls: type, values: dict[str, Any], section: str) -> Any:
    types_ = _field_types(cls)
    unknown = sorted(set(values) - set(types_))
    if unknown:
        raise ConfigError(
            f"unknown option {section}.{_key_shown(unknown[0])}; valid options in [{section}] are: {', '.join(types_)}."
        )
    built = {}
    for key, value in values.items():
        if _is_table(types_[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"[{section}.{key}] must be a table of options, got {value!r}.")
            built[key] = _build_section(types_[key], value, f"{section}.{key}")
        else:
            built[key] = _coerce(value, types_[key], f"{section}.{key}")
    return cls(**built)


def _move_legacy_keys(tree: dict[str, Any]) -> list[str]:
    """Move [strategy]'s flat keys of before its tables (comm_hook) to their tables (ddp.comm_hook), in place; the
    keys moved, as `old -> new` for the note that names them."""
    strategy = tree.get("strategy")
    if not isinstance(strategy, dict):
        return []
    moved = []
    for old in [key for key in strategy if key in LEGACY_STRATEGY_KEYS]:
        table, option = LEGACY_STRATEGY_KEYS[old].split(".")
        into = strategy.setdefault(table, {})
        if not isinstance(into, dict):
            raise ConfigError(f"[strategy.{table}] must be a table of options, got {into!r}.")
        if option in into:
            raise ConfigError(f"strategy.{old} and strategy.{table}.{option} are the same option, given twice; keep "
                              f"strategy.{table}.{option} only.")
        into[option] = strategy.pop(old)
        moved.append(f"strategy.{old} -> strategy.{table}.{option}")
    return moved


def upgraded(tree: Any) -> Any:
    """A copy of a config tree as today's code writes it, for records written before (a sweep's sweep.json):
    [strategy]'s flat keys of before the tables moved to their tables (no note), and an option added since at its
    default, which is what that record ran with. Anything but a table is returned as it is."""
    if not isinstance(tree, dict):
        return tree
    copy = _deep_copy(tree)
    try:
        _move_legacy_keys(copy)
    except ConfigError:  # a key given twice: left as it is, so that it compares unequal
        return tree
    for section, options in to_dict(RunConfig()).items():  # the sections it records (a record may leave some out)
        if isinstance(copy.get(section), dict):
            _fill_defaults(copy[section], options)
    return copy


def _fill_defaults(table: dict[str, Any], defaults: dict[str, Any]) -> None:
    """The options a table lacks, from defaults, its own tables too; what it has stays as it is."""
    for key, value in defaults.items():
        if key not in table:
            table[key] = _deep_copy(value)
        elif isinstance(value, dict) and isinstance(table[key], dict):
            _fill_defaults(table[key], value)


def _note_legacy_keys(moved: list[str]) -> None:
    if moved:
        logging.getLogger("dptrain").warning(
            "each strategy's options now sit in its own table; read as the new keys, which to write instead (the old "
            "ones are read for one release only): %s", ", ".join(moved))


def from_dict(tree: dict[str, Any]) -> RunConfig:
    """Build a validated RunConfig from nested plain data (a parsed TOML file, or to_dict() output)."""
    sections = _field_types(RunConfig)
    unknown = sorted(set(tree) - set(sections))
    if unknown:
        raise ConfigError(f"unknown config section [{_key_shown(unknown[0])}]; valid sections are: {', '.join(sections)}.")
    if any(key in LEGACY_STRATEGY_KEYS for key in tree.get("strategy") or ()):  # a config.toml of before the tables
        tree = {**tree, "strategy": _deep_copy(tree["strategy"])}
        _note_legacy_keys(_move_legacy_keys(tree))
    built = {}
    for name, cls in sections.items():
        values = tree.get(name, {})
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table of options, got {values!r}.")
        built[name] = _build_section(cls, values, name)
    return RunConfig(**built)


def _deep_copy(values: Any) -> Any:
    return {k: _deep_copy(v) for k, v in values.items()} if isinstance(values, dict) else values


def to_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Nested plain data; from_dict(to_dict(c)) == c."""
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in _field_types(RunConfig)}


def _flat_fields(cls: type, prefix: str) -> Iterator[tuple[str, dataclasses.Field]]:
    """Every option of a section as (dotted name, its field), tables' options included."""
    for f in dataclasses.fields(cls):
        tp = _field_types(cls)[f.name]
        if _is_table(tp):
            yield from _flat_fields(tp, f"{prefix}.{f.name}")
        else:
            yield f"{prefix}.{f.name}", f


def fixed_at_resume(cfg: RunConfig) -> dict[str, Any]:
    """Every option that a resume must keep (it changes the computation), by dotted name; the others' fields, or
    their sections', say MAY_CHANGE_AT_RESUME."""
    fixed = {}
    for section in dataclasses.fields(RunConfig):
        if section.metadata.get("may_change_at_resume"):
            continue
        for name, f in _flat_fields(_field_types(RunConfig)[section.name], section.name):
            if not f.metadata.get("may_change_at_resume"):
                value: Any = cfg
                for part in name.split("."):
                    value = getattr(value, part)
                fixed[name] = value
    return fixed


def current_name(name: str) -> str:
    """An option's dotted name as a snapshot of before the strategy tables recorded it (strategy.comm_hook), now."""
    section, _, rest = name.partition(".")
    key, space, words = rest.partition(" ")  # "strategy.deepspeed_config (sha256 of its settings)"
    if section == "strategy" and key in LEGACY_STRATEGY_KEYS:
        return f"strategy.{LEGACY_STRATEGY_KEYS[key]}{space}{words}"
    return name


def parse_overrides(pairs: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """[("optim.lr", "3e-4"), ("strategy.ddp.comm_hook", "fp16")] -> {"optim": {"lr": "3e-4"}, "strategy": {"ddp":
    {"comm_hook": "fp16"}}}; strings are typed later by from_dict. Old flat strategy keys are moved to their tables."""
    return _parse_overrides(pairs)[0]


def _parse_overrides(pairs: list[tuple[str, str]]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    tree: dict[str, dict[str, Any]] = {}
    sections = _field_types(RunConfig)
    for key, value in pairs:
        section, *path = key.split(".")
        if not path or not all(path) or len(path) > 2:
            raise ConfigError(f"option --{key} is not of the form --section.option (for example --optim.lr 3e-4, "
                              f"or --strategy.ddp.comm_hook fp16 for a strategy's own option).")
        if section not in sections:
            raise ConfigError(f"unknown option --{key}; valid sections are: {', '.join(sections)}.")
        into = tree.setdefault(section, {})
        if len(path) == 2:
            table = into.setdefault(path[0], {})
            if not isinstance(table, dict):
                raise ConfigError(f"option --{section}.{path[0]} is a table of options, not a value; give one of its "
                                  f"options, as --{key} does.")
            into = table
        into[path[-1]] = value
    return tree, _move_legacy_keys(tree)


def _merge(base: dict[str, Any], over: dict[str, Any], where: str) -> None:
    """over's values into base, table by table (a CLI option replaces the file's value, and only it)."""
    for key, value in over.items():
        if isinstance(value, dict):
            inner = base.setdefault(key, {})
            if not isinstance(inner, dict):
                raise ConfigError(f"[{key}] must be a table of options in {where}.")
            _merge(inner, value, where)
        else:
            base[key] = value


# Bounds on a config file (TOML, or DeepSpeed's JSON), checked before a parser sees it. A config is a few KB:
# /dev/zero given as one was read until memory ran out (7 GB); tomllib's time grows with the square of a dotted key's
# parts (50,000 parts: 61 s, 15 GB); tomllib and json recurse once per level of brackets (RecursionError near 1,000);
# Python refuses integers of over 4,300 digits with a ValueError that neither parser turns into its own error.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_NESTING = 32
MAX_KEY_PARTS = 16
MAX_WORD_CHARS = 100
# TOML's strings and comments (JSON's strings are a subset). Once started, a match cannot fail (an unterminated string
# ends at the end of its line, or of the text for a multi-line one; a backslash at the end is taken alone), so every
# match consumes what it scanned and the scan is linear in the text (a failing match retried from every quote was not).
_STRINGS_AND_COMMENTS = re.compile(r'"""(?:\\.?|[^\\])*?(?:"""|\Z)|\'\'\'.*?(?:\'\'\'|\Z)|"(?:\\.?|[^"\\\n])*(?:"|\n|\Z)'
                                   r"|'[^'\n]*(?:'|\n|\Z)|#[^\n]*", re.DOTALL)
_DOTTED_WORDS = re.compile(r"[\w+:-]+(?:[ \t]*\.[ \t]*[\w+:-]+)*")  # a bare or dotted key, a number, a date


def read_config_text(path: Path, where: str) -> str:
    """A config file's text, refused in one sentence (ConfigError starting with `where`) where it is a directory,
    unreadable, over MAX_CONFIG_BYTES, not UTF-8, or nests, dots or spells out its words beyond any config's needs.
    FileNotFoundError is left to the caller, whose sentence says where the path came from."""
    try:  # a regular file only (a link to /dev/zero, a FIFO: refused, not read), never more than the cap
        data = read_back.read_bytes(Path(path), MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise
    except read_back.UnreadableFile as exc:
        if exc.problem.startswith("is larger"):
            raise ConfigError(f"{where} is larger than {MAX_CONFIG_BYTES >> 20} MiB, far more than a config holds; "
                              f"check that the path names the right file.") from None
        if exc.problem.startswith("is a folder"):
            raise ConfigError(f"{where} is a directory, not a file; give the path of the file.") from None
        raise ConfigError(f"{where} {exc.problem}; check that the path names the right file.") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where} is not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x}; a binary file?); "
                          f"check that the path names the right file.") from None
    bare = _STRINGS_AND_COMMENTS.sub(lambda m: "" if m.group().startswith("#") else "s", text)
    depth = 0
    for bracket in re.sub(r"[^\[\]{}]+", "", bare):
        depth += 1 if bracket in "[{" else -1
        if depth > MAX_CONFIG_NESTING:
            raise ConfigError(f"{where} nests brackets more than {MAX_CONFIG_NESTING} deep, far more than a config "
                              f"needs; fix the file.")
    for words in _DOTTED_WORDS.finditer(bare):
        parts = words.group().split(".")
        if len(parts) > MAX_KEY_PARTS:
            raise ConfigError(f"{where} has a dotted key of {len(parts)} parts (at most {MAX_KEY_PARTS}: an option is "
                              f"section.option); fix the file.")
        if max(map(len, parts)) > MAX_WORD_CHARS:
            raise ConfigError(f"{where} has a key or number longer than {MAX_WORD_CHARS} characters; fix the file.")
    return text


def read_toml(path: Path, where: str) -> dict[str, Any]:
    """A TOML file's tables, through read_config_text's bounds: the one way dptrain reads TOML (tomllib, or tomli on
    Python 3.10). ConfigError in one sentence starting with `where`; FileNotFoundError is left to the caller."""
    try:
        return tomllib.loads(read_config_text(path, where))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where} is not valid TOML ({exc}); fix the file.") from None


def load(path: str | Path | None = None, overrides: list[tuple[str, str]] | None = None) -> RunConfig:
    """TOML file (optional) with dotted overrides on top, validated."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            tree = read_toml(path, f"config file {path}")
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist; check the path given to --config.") from None
    moved = _move_legacy_keys(tree)
    over, moved_here = _parse_overrides(overrides or [])
    _merge(tree, over, str(path))
    _note_legacy_keys(moved + moved_here)
    return from_dict(tree)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise AssertionError(f"cannot write {value!r} as TOML")


def to_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML that load() reads back; None values are left out (None is the default)."""
    lines: list[str] = []

    def table(name: str, values: dict[str, Any]) -> None:
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None and not isinstance(v, dict))
        lines.append("")
        for key, inner in values.items():
            if isinstance(inner, dict):
                table(f"{name}.{key}", inner)

    for section, values in to_dict(cfg).items():
        table(section, values)
    return "\n".join(lines)


# ---------------------------------------------------------------- the options, as --help lists them


@dataclass(frozen=True)
class Option:
    """One --section.option: its value as typed on the command line, its default so typed, its field docstring."""

    section: str
    name: str
    metavar: str
    default: str
    doc: str


def _metavar(tp: Any) -> str:
    """What _coerce accepts for this type: INT, FLOAT, TEXT, {a,b}, INT,INT,INT, with |none where None is allowed."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return "|".join(_metavar(a).strip("{}") for a in inner) + ("|none" if type(None) in args else "")
    if origin is Literal:
        return "{" + ",".join(map(str, args)) + "}"
    if origin is tuple and args[-1] is Ellipsis:  # a list of lines (TOML); on the command line, one
        return "LINE" if args[0] is str else f"{_metavar(args[0])},..."
    if origin is tuple:
        return ",".join(_metavar(a) for a in args)
    if tp is bool:
        return "{true,false}"
    return {int: "INT", float: "FLOAT", str: "TEXT"}[tp]


def _cli_value(value: Any) -> str:
    """A value as typed after --section.option; _coerce reads it back to the same value."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == ():
        return "[]"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


@functools.cache
def _docs_by_class() -> dict[str, dict[str, str]]:
    """Class name -> field -> the field's attribute docstring (the string literal after the field), which Python
    keeps nowhere at run time; this module's source is parsed once (getsource per class would parse it per class)."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    except (OSError, TypeError):  # no source shipped (a frozen app): --help lists the options without their docs
        return {}
    return {
        cls.name: {
            node.target.id: inspect.cleandoc(doc.value.value)
            for node, doc in zip(cls.body, cls.body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)
        }
        for cls in tree.body if isinstance(cls, ast.ClassDef)
    }


def field_docs(cls: type) -> dict[str, str]:
    """Field -> docstring of a section dataclass of this module."""
    return _docs_by_class().get(cls.__name__, {})


@functools.cache
def options() -> tuple[Option, ...]:
    """Every option of every section, in declaration order; a strategy's own options in their table's section
    (strategy.ddp), after the section's own."""
    found: list[Option] = []

    def add(section: str, cls: type, defaults: dict[str, Any]) -> None:
        types_ = _field_types(cls)
        found.extend(Option(section, name, _metavar(tp), _cli_value(defaults[name]), field_docs(cls).get(name, ""))
                     for name, tp in types_.items() if not _is_table(tp))
        for name, tp in types_.items():
            if _is_table(tp):
                add(f"{section}.{name}", tp, defaults[name])

    defaults = to_dict(RunConfig())
    for section, cls in _field_types(RunConfig).items():
        add(section, cls, defaults[section])
    return tuple(found)


def options_help(width: int = 72) -> dict[str, str]:
    """Section -> its options as --help lists them: `--section.option METAVAR  (default: X)`, then the docstring."""
    text: dict[str, list[str]] = {}
    for opt in options():
        lines = text.setdefault(opt.section, [])
        lines.append(f"--{opt.section}.{opt.name} {opt.metavar}  (default: {opt.default})")
        lines += textwrap.wrap(" ".join(opt.doc.split()), width, initial_indent="    ", subsequent_indent="    ",
                               break_long_words=False, break_on_hyphens=False)
    return {section: "\n".join(lines) for section, lines in text.items()}
