"""DeepSpeed's engine as one more strategy: ZeRO stage 1, 2 or 3 over dptrain's process group.

    $ pip install 'dptrain[deepspeed]'
    $ dptrain train --strategy.name deepspeed --strategy.deepspeed.zero_stage 3 --nproc-per-node 4
    $ dptrain train --strategy.name deepspeed --strategy.deepspeed.config ds_config.json

dptrain's options stay the one source of what is computed: the batch, the optimizer (train.optimizer_spec,
handed to DeepSpeed as its client optimizer), the learning-rate schedule, gradient clipping, precision
(train.bf16 autocasts, as for every strategy) and the ZeRO stage. A user's ds_config.json adds the engine's
own settings (buckets, overlap, communication dtype, ...). Where it states one of dptrain's that the run does
not set itself (train_batch_size, gradient_accumulation_steps, the Adam/AdamW/SGD optimizer's params,
gradient_clipping, a WarmupLR scheduler), adopt_user_config takes the file's value into the options, as the
tutorials' files expect; where the run sets it too, both must agree, and a contradiction is refused in one sentence
before any worker starts (check_run). Snapshots hold DeepSpeed's own checkpoint (engine.save_checkpoint / load_checkpoint) in a subfolder, written and read as
plain data (PlainDataCheckpointEngine), besides the model in DCP for `dptrain eval` and `predict`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import warnings
from collections.abc import Collection
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from dptrain.config import LaunchConfig, RunConfig, StrategyConfig
from dptrain.errors import ConfigError
from dptrain.strategies.base import OptimizerSpec, Strategy
from dptrain.strategies.state import OwnFolder, Shards, StatePart
from dptrain.strategies.deepspeed.ds_config import (adopt_user_config, check_against_run, config_digest, engine_config,
                                                    read_user_config, settings_line)
from dptrain.strategies.deepspeed.options import SPEC
from dptrain.strategies.deepspeed.plain_data import plain_data_checkpoint_engine

log = logging.getLogger("dptrain")

INSTALL = "pip install 'dptrain[deepspeed]'"
TAG = "deepspeed"  # DeepSpeed's checkpoint tag: the snapshot's subfolder holding its files
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # copied beside the tag by save_checkpoint
# Keys of a ds_config.json that dptrain sets itself (after checking the file's against dptrain's options).
def skip_shared_memory_op() -> None:
    """Keep DeepSpeed from building its shared-memory all-reduce when its communication backend starts (call before
    deepspeed.init_distributed): on the CPU it is JIT-compiled first (about 75 s on 2 cores, once per machine), and
    only DeepSpeed's inference all-reduce uses it; training reduces through torch.distributed either way.
    (importlib: `import deepspeed.comm.torch as m` gives torch itself, which deepspeed.comm re-exports as `torch`.)"""
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


# ---------------------------------------------------------------- what the loop sees


class EngineForward(nn.Module):
    """What the loop calls for training forward passes: the DeepSpeed engine, made by build_optimizer()."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.engine: nn.Module | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        assert self.engine is not None, "build_optimizer() first"
        return self.engine(*args, **kwargs)


class EngineOptimizer(torch.optim.Optimizer):
    """The optimizer the loop and the learning-rate schedule hold: param groups whose rates the schedule sets.

    step() hands every hyper-parameter of its groups (the rate, and the betas or momentum that one-cycle moves)
    to DeepSpeed's optimizer, then runs the engine's step: gradient reduction, clipping, update, ZeRO's gathers.
    """

    def __init__(self, engine: Any, params: list[nn.Parameter]) -> None:
        self.engine = engine
        inner = engine.optimizer.param_groups
        assert len(inner) == 1, "dptrain hands DeepSpeed one parameter group"
        super().__init__([{"params": params}], {k: v for k, v in inner[0].items() if k != "params"})

    def step(self, closure: Any = None) -> None:  # noqa: ARG002 - torch's signature
        for mine, theirs in zip(self.param_groups, self.engine.optimizer.param_groups):
            theirs.update({key: value for key, value in mine.items() if key != "params"})
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.optimizer.zero_grad(set_to_none=set_to_none)


# ---------------------------------------------------------------- the strategy


@contextlib.contextmanager
def _accelerator_chosen(device: torch.device) -> Iterator[None]:
    """On the CPU, DS_ACCELERATOR=cpu while deepspeed first picks its accelerator (once per process): else a machine
    with GPUs picks CUDA. The variable is restored after, so that processes started later do not inherit it."""
    if device.type != "cpu":
        yield
        return
    previous = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["DS_ACCELERATOR"]
        else:
            os.environ["DS_ACCELERATOR"] = previous


class DeepSpeed(Strategy):
    """DeepSpeed's engine: forward through it, backward and step by it; ZeRO's collectives are its own.

    Traffic computed per step, (N-1)/N of the bytes each: ZeRO 1 and 2 reduce the gradients (in DeepSpeed's
    communication dtype) and all-gather the updated parameters; ZeRO 3 all-gathers the parameters in forward
    and again in backward, and reduce-scatters the gradients.
    """

    spec = SPEC
    step_is_local = False  # collectives inside the step
    fp16_refusal = ("strategy deepspeed scales float16 losses with its own engine (its fp16 section), which dptrain "
                    "does not run; use --train.bf16 true, or strategy ddp or zero1 for train.fp16.")
    resumes_on_another_world = False  # its engine's own checkpoint is per rank (state.OwnFolder)

    def __init__(self, cfg: StrategyConfig, env: Any, device: torch.device,
                 timeout_s: float = LaunchConfig.timeout_s, micro_batches: int = 1) -> None:
        super().__init__(cfg, env, device, timeout_s, micro_batches)
        self.engine: Any = None
        self.forward_module: EngineForward | None = None
        self.micro_batch = 0  # what DeepSpeed's counters were last told

    @classmethod
    def check_world(cls, cfg: StrategyConfig, world_size: int, on_cpu: bool, torch_version: str) -> None:
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(f"strategy deepspeed needs DeepSpeed, which is not installed here; run {INSTALL}, "
                              f"or use --strategy.name fsdp or zero1 for ZeRO without it.")

    @classmethod
    def adopt_settings(cls, cfg: RunConfig, given: Collection[str]) -> RunConfig:
        """The tutorials' ds_config.json (strategy.deepspeed.config): its batch, Adam parameters, clipping and WarmupLR
        taken into the options the user did not set."""
        return adopt_user_config(cfg, given)

    @classmethod
    def settings_from_file(cls, cfg: RunConfig) -> str | None:
        """The settings strategy.deepspeed.config states, in one line (settings_line)."""
        path = cfg.strategy.deepspeed.config
        return None if path is None else settings_line(path)

    @classmethod
    def computation_options(cls, cfg: RunConfig) -> dict[str, Any]:
        """What strategy.deepspeed.config says (the file may move, or another may say the same): its settings' digest."""
        path = cfg.strategy.deepspeed.config
        return {} if path is None else {"strategy.deepspeed.config (sha256 of its settings)": config_digest(path)}

    @classmethod
    def check_run(cls, cfg: RunConfig, world_size: int, on_cpu: bool) -> None:
        if cfg.strategy.deepspeed.config is not None:
            check_against_run(read_user_config(cfg.strategy.deepspeed.config), cfg, world_size, on_cpu)

    def wrap(self, model: nn.Module) -> nn.Module:
        # DeepSpeed flattens the parameters and broadcasts them as bytes, which needs contiguous ones: channels_last
        # weights go back to NCHW (inputs may stay NHWC).
        self.module = model.to(self.device, memory_format=torch.contiguous_format)
        self.forward_module = EngineForward(self.module)
        return self.forward_module

    def build_optimizer(self, model: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
        deepspeed = self._import_deepspeed()
        user = self._user_config()
        # device_rank: DeepSpeed would take LOCAL_RANK for the device index, which differs from it with one GPU per
        # SLURM task; dist_init_required=False: it wraps dptrain's process group instead of making one.
        args = SimpleNamespace(device_rank=self.device.index if self.device.type == "cuda" else 0)
        engine, _, _, _ = deepspeed.initialize(args=args, model=model, optimizer=spec.build, model_parameters=model.parameters(),
                                               config=engine_config(user, self.cfg.deepspeed.zero_stage, self.micro_batches),
                                               dist_init_required=False)
        engine.checkpoint_engine = plain_data_checkpoint_engine()
        line = settings_line(self.cfg.deepspeed.config) if self.cfg.deepspeed.config is not None else None
        if line is not None and self.env.is_main:  # once a run, as it starts
            log.info(line)
        self.engine = engine
        assert self.forward_module is not None, "wrap() first"
        self.forward_module.engine = engine
        return EngineOptimizer(engine, list(model.parameters()))

    def _import_deepspeed(self) -> Any:
        """deepspeed, imported for this device, joined to dptrain's process group."""
        os.environ.setdefault("LOCAL_RANK", str(self.env.local_rank))  # DeepSpeed asserts it is set (SLURM sets SLURM_LOCALID)
        with _accelerator_chosen(self.device):
            import deepspeed
            from deepspeed.accelerator import get_accelerator
            from deepspeed.utils import groups, logger

            picked = get_accelerator().device_name()
        if picked != self.device.type:
            raise ConfigError(f"DeepSpeed already runs on its {picked} accelerator in this process, and this run is on "
                              f"{self.device}; start a fresh process (or set DS_ACCELERATOR={self.device.type}).")
        logger.setLevel(logging.WARNING)  # its INFO lines (the config dump, each save and load) drown dptrain's log
        logging.getLogger("compilers").setLevel(logging.WARNING)  # setuptools: each gcc line of DeepSpeed's op probe
        # torch's advice to DeepSpeed, which calls these every step, not to the user.
        warnings.filterwarnings("ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
                                FutureWarning)
        # DeepSpeed keeps a clone of the world group from any earlier world in this process (tests, in-process runs).
        release = getattr(groups, "_release_process_group_references", None)
        if release is not None:
            release()
        else:  # pragma: no cover - DeepSpeed before 0.18
            groups._WORLD_GROUP = None
        skip_shared_memory_op()
        deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
        return deepspeed

    def _user_config(self) -> dict[str, Any]:
        """The JSON (checked by check_run in every worker), the same on every rank: one file read on each host."""
        path = self.cfg.deepspeed.config
        user = read_user_config(path) if path is not None else {}
        if self.env.world_size > 1:
            digests: list[Any] = [None] * self.env.world_size
            dist.all_gather_object(digests, hashlib.sha256(json.dumps(user, sort_keys=True).encode()).hexdigest())
            differing = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
            if differing:
                raise ConfigError(f"strategy.deepspeed.config {path} reads differently on rank {differing[0]} than on rank 0 "
                                  f"(another file on that host); give every host the same file.")
        return user

    def backward(self, loss_sum: torch.Tensor, global_count: int) -> None:
        share = max(1, global_count // (self.env.world_size * self.micro_batches))
        if share != self.micro_batch:  # DeepSpeed's sample counters; two attributes, no collective
            self.engine.set_train_micro_batch_size(share)
            self.micro_batch = share
        # DeepSpeed averages the gradients over the ranks; the loss is already a share of the global batch's mean, so
        # not divided by gradient_accumulation_steps again (scale_wrt_gas).
        self.engine.backward(loss_sum * (self.env.world_size / global_count), scale_wrt_gas=False)

    def gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """DeepSpeed's own boundary (set_gradient_accumulation_boundary): the step's last micro-batch is its
        accumulation boundary, where ZeRO-1 reduces the summed gradients (ZeRO-2 and 3 reduce each micro-batch's into
        their partitions, as DeepSpeed does); engine.step() then updates once."""
        self.engine.set_gradient_accumulation_boundary(sync)
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> None:
        # The gradients are reduced, partitioned and clipped inside engine.step(), which scales them by
        # max_norm / (norm + 1e-6) where that is below 1, as torch does; here DeepSpeed is told the bound.
        self.engine.optimizer.clip_grad = max_norm

    # Accounting

    def memory_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        params = list(self.eval_module.parameters())
        held = [getattr(p, "ds_tensor", p) for p in params]  # ZeRO-3: this rank's partition
        base = self.engine.optimizer.optimizer  # the torch optimizer over this rank's flat float32 partitions
        masters = list(base.state)  # those partitions (ZeRO-3 lends them to its param groups only while stepping)
        state = [v for s in base.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        return {"params": sum(t.numel() * t.element_size() for t in held),
                "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
                "optim": sum(t.numel() * t.element_size() for t in masters + state)}

    def comm_bytes(self, steps: int) -> int:
        params = list(self.eval_module.parameters())
        numel = sum(getattr(p, "ds_numel", p.numel()) for p in params)
        param_size = params[0].element_size()
        grad_size = torch.empty(0, dtype=self.engine.communication_data_type).element_size()
        stage, pieces = self.cfg.deepspeed.zero_stage, self.micro_batches
        # ZeRO-3 gathers the parameters in each micro-batch's forward and backward; ZeRO-2 and 3 reduce each
        # micro-batch's gradients, ZeRO-1 the step's sum once (train.accumulate_steps)
        gathers = 2 * pieces if stage == 3 else 1
        reductions = pieces if stage >= 2 else 1
        world = self.env.world_size
        return steps * (gathers * numel * param_size + reductions * numel * grad_size) * (world - 1) // world

    # Snapshots: the model in DCP (whole, for eval and predict), everything else in DeepSpeed's own checkpoint.

    @contextlib.contextmanager
    def _whole_parameters(self) -> Iterator[None]:
        """ZeRO-3's parameters gathered on every rank (a collective), partitioned again on exit."""
        if self.cfg.deepspeed.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.eval_module.parameters())):
                yield
        else:
            yield

    def state_parts(self, optimizer: torch.optim.Optimizer) -> list[StatePart]:
        """The whole model in DCP, for `dptrain eval` and `predict` (a resume restores it from DeepSpeed's checkpoint,
        with the optimizer); everything else in DeepSpeed's own checkpoint, in the snapshot's subfolder TAG."""

        def whole_model() -> dict[str, Any]:
            with self._whole_parameters():
                return {"model": {k: v.detach().clone() for k, v in self.eval_module.state_dict().items()}}

        return [Shards("model", whole_model, lambda shards: None),
                OwnFolder("engine", self._save_engine, self._load_engine, self._engine_files)]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        with self._whole_parameters():
            return {k: v.detach().cpu().clone() for k, v in self.eval_module.state_dict().items()}

    def _save_engine(self, snapshot: Path) -> None:
        self.engine.save_checkpoint(str(snapshot), tag=TAG, client_state={}, save_latest=False)
        if self.env.global_rank == 0:  # save_checkpoint ends with a barrier: every rank's files are written
            for script in RECOVERY_SCRIPTS:  # a snapshot holds data, never code
                (snapshot / script).unlink(missing_ok=True)

    def _load_engine(self, snapshot: Path) -> None:
        loaded, _ = self.engine.load_checkpoint(str(snapshot), tag=TAG, load_optimizer_states=True,
                                                load_lr_scheduler_states=False)
        assert loaded is not None, f"DeepSpeed found no checkpoint in {snapshot / TAG}, which verify() passed"

    def _engine_files(self) -> set[str]:
        """DeepSpeed's file names (stable since 0.3): the model on rank 0, with ZeRO-3 on every rank; the
        optimizer's partition of every rank."""
        world, stage = self.env.world_size, self.cfg.deepspeed.zero_stage
        models = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)] if stage == 3 else ["mp_rank_00_model_states.pt"]
        optims = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
        return {f"{TAG}/{name}" for name in models + optims}
