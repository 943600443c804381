"""A user's ds_config.json, read and checked against the run (torch-free): its values in range, the settings dptrain
takes from it into the options the run does not set (adopt_user_config: train_batch_size, gradient_accumulation_steps,
the optimizer's params, gradient_clipping, WarmupLR), a contradiction with the run's own refused in one sentence
(check_against_run), and the engine's config made from it (engine_config)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dptrain.config import FLOAT32_MAX, FLOAT32_TINY, RunConfig, from_dict, read_config_text, to_dict
from dptrain.errors import ConfigError

DPTRAIN_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
                "optimizer", "scheduler", "fp16", "bf16", "amp", "torch_autocast")
PRECISION_SECTIONS = ("bf16", "amp", "torch_autocast")  # fp16 has sentences of its own
OFFLOADS = {"offload_optimizer": "the optimizer state", "offload_param": "the parameters"}
OPTIMIZER_TYPES = {"sgd": "sgd", "adamw": "adamw"}  # DeepSpeed's type (lower case) -> optim.name; "adam": see below
OPTIMIZER_PARAMS = {"sgd": ("lr", "weight_decay", "momentum"), "adam": ("lr", "weight_decay", "betas", "eps")}
"""The optimizer params dptrain reads from the file, each into optim.<param>; adamw takes adam's."""
# DeepSpeed's WarmupLR where the file is silent: from 0 to the optimizer's lr over 1000 steps, along a log curve
# (strategy.deepspeed.warmup_type log; "linear" where the file says so).
WARMUP_LR_DEFAULTS = {"warmup_min_lr": 0, "warmup_num_steps": 1000, "warmup_type": "log"}
WARMUP_TYPES = ("linear", "log")  # DeepSpeed's two; it takes any other name for log, with a warning


@dataclass(frozen=True)
class FileValue:
    """A key of the file that dptrain reads: the JSON type its value must have, the option the value goes into (whose
    own checks it must pass too: a rate within 32-bit floats, a step count 0 or more), and a valid value in words."""

    kind: Literal["count", "integer", "number", "pair", "switch"]
    option: str | None
    valid: str
    zero_is_none: bool = False  # gradient_clipping 0: no clipping, train.grad_clip none


RATE = f"a number from {FLOAT32_TINY:.2g} to {FLOAT32_MAX:.3g}"
SWITCH = 'true, false or "auto"'
BETAS = "two numbers from 0 up to (not including) 1, like [0.9, 0.999]"
# Each key of the file that dptrain reads or compares with its options. Read as they came, a value of another type was
# compared with the option, and the advice to set the option to it could not work ("lr": "0.01" -> set --optim.lr
# 0.01, then the same sentence again; train_batch_size true -> --train.global_batch_size True); and one out of the
# option's range was taken into it (warmup_num_steps 1e30). "auto" (Hugging Face's placeholder) is dptrain's value.
FILE_VALUES = {
    "train_batch_size": FileValue("count", "train.global_batch_size", "an integer above 0"),
    "train_micro_batch_size_per_gpu": FileValue("count", None, "an integer above 0"),
    "gradient_accumulation_steps": FileValue("count", "train.accumulate_steps", "an integer above 0"),
    "gradient_clipping": FileValue("number", "train.grad_clip", f"0 (no clipping) or {RATE}", zero_is_none=True),
    "optimizer.params.lr": FileValue("number", "optim.lr", RATE),
    "optimizer.params.weight_decay": FileValue("number", "optim.weight_decay", f"0 or {RATE}"),
    "optimizer.params.momentum": FileValue("number", "optim.momentum", f"0 or {RATE}"),
    "optimizer.params.betas": FileValue("pair", "optim.betas", BETAS),
    "optimizer.params.eps": FileValue("number", "optim.eps", RATE),
    "optimizer.params.adam_w_mode": FileValue("switch", None, "true or false"),
    "optimizer.params.torch_adam": FileValue("switch", None, "true or false"),
    "scheduler.params.warmup_num_steps": FileValue("integer", "optim.warmup_steps", "an integer 0 or more"),
    "scheduler.params.warmup_max_lr": FileValue("number", "optim.lr", RATE),
    "scheduler.params.warmup_min_lr": FileValue("number", None, "0"),
    **{f"{name}.enabled": FileValue("switch", None, SWITCH) for name in ("fp16", *PRECISION_SECTIONS)},
}


def read_user_config(path: str) -> dict[str, Any]:
    """The ds_config.json as a dict; ConfigError in one sentence if it is missing, unreadable, not a small text file
    (read_config_text's bounds) or not a JSON object."""
    where = f"strategy.deepspeed.config {path}"
    try:
        text = read_config_text(Path(path), where)
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist; check the path, or leave the option out for DeepSpeed's defaults.") from None
    def finite(number_text: str) -> float:  # JSON's NaN and Infinity (Python's json reads them), and 1e400
        number = float(number_text)
        if not math.isfinite(number):
            raise ConfigError(f"{where} holds the number {number_text}, which is not finite; put a finite number in the "
                              f"file there, or remove that setting.")
        return number

    try:
        tree = json.loads(text, parse_float=finite, parse_constant=finite)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); fix the file.") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{where} holds a JSON {type(tree).__name__}, not an object of DeepSpeed settings; "
                          f'give a file like {{"zero_optimization": {{"stage": 2}}}}.')
    _check_values(tree, path)
    return tree


def _check_values(tree: dict[str, Any], path: str) -> None:
    """ConfigError naming the first key of FILE_VALUES whose value is of another type, or out of its option's range."""
    for key, spec in FILE_VALUES.items():
        *sections, name = key.split(".")
        table = tree
        for section in sections:
            table = _section(table, section, path)
        if name not in table or table[name] == "auto":
            continue
        value = table[name]
        if not _valid(spec, value):
            quoted = " (text: JSON writes numbers, true and false without quotes)" if isinstance(value, str) else ""
            shown = json.dumps(value)  # escaped: no line break or escape reaches the console
            shown = shown if len(shown) <= 60 else f"{shown[:60]}... ({len(shown)} characters)"
            raise ConfigError(f"{path} sets {key} {shown}{quoted}, where dptrain takes {spec.valid}; fix the value, or "
                              f"remove {key} from the file.")


def _valid(spec: FileValue, value: Any) -> bool:
    typed = {"count": _integer(value) and value > 0, "integer": _integer(value), "number": _number(value),
             "pair": isinstance(value, list) and len(value) == 2 and all(map(_number, value)),
             "switch": isinstance(value, bool)}[spec.kind]
    if not typed or spec.option is None or (spec.zero_is_none and value == 0):
        return typed
    section, option = spec.option.split(".")
    try:  # the option's own checks, on this value alone
        from_dict({section: {option: value}})
    except ConfigError:
        return False
    return True


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def config_digest(path: str | None) -> str | None:
    """sha256 of the JSON's settings (not of its spacing), for a snapshot's manifest; None without a file."""
    if path is None:
        return None
    return hashlib.sha256(json.dumps(read_user_config(path), sort_keys=True).encode()).hexdigest()[:16]


def _section(tree: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    value = tree.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"strategy.deepspeed.config {path}: {key} must be a JSON object, not {json.dumps(value)}; fix the file.")
    return value


def _enabled(section: dict[str, Any]) -> bool:
    """A precision section's "enabled"; "auto" (Hugging Face's placeholder) leaves the choice to dptrain."""
    return section.get("enabled", False) not in (False, "auto")


def _given(tree: dict[str, Any], key: str) -> bool:
    """Whether the file states a value for key ("auto" states none: dptrain's value is taken)."""
    return key in tree and tree[key] != "auto"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _optimizer_name(section: dict[str, Any], params: dict[str, Any]) -> str | None:
    """dptrain's optim.name for the file's optimizer type; None if dptrain builds no such optimizer. DeepSpeed's
    "Adam" is AdamW (decoupled weight decay) unless adam_w_mode is false."""
    kind = str(section.get("type", "")).lower()
    return {"adam": "adamw" if params.get("adam_w_mode", True) else "adam"}.get(kind, OPTIMIZER_TYPES.get(kind))


def file_options(tree: dict[str, Any], path: str) -> dict[str, Any]:
    """The file's settings that are dptrain options, as dotted option names -> values. Only well-formed values are
    read: anything else is left to check_against_run, which names the key."""
    found: dict[str, Any] = {}
    if _given(tree, "train_batch_size") and _number(tree["train_batch_size"]) and tree["train_batch_size"] > 0:
        found["train.global_batch_size"] = tree["train_batch_size"]
    if _given(tree, "gradient_accumulation_steps") and _number(tree["gradient_accumulation_steps"]):
        found["train.accumulate_steps"] = tree["gradient_accumulation_steps"]
    if _given(tree, "gradient_clipping") and _number(tree["gradient_clipping"]):
        found["train.grad_clip"] = tree["gradient_clipping"] or None  # DeepSpeed's 0 is no clipping
    if "optimizer" in tree:
        section = _section(tree, "optimizer", path)
        params = _section(section, "params", path)
        name = _optimizer_name(section, params)
        if name is not None:
            found["optim.name"] = name
            for key in OPTIMIZER_PARAMS["sgd" if name == "sgd" else "adam"]:
                value = params.get(key)
                if _number(value) or (key == "betas" and isinstance(value, list) and all(map(_number, value))):
                    found[f"optim.{key}"] = value
    if "scheduler" in tree:
        section = _section(tree, "scheduler", path)
        steps = _section(section, "params", path).get("warmup_num_steps", WARMUP_LR_DEFAULTS["warmup_num_steps"])
        if section.get("type") == "WarmupLR" and isinstance(steps, int) and not isinstance(steps, bool):
            found.update({"optim.schedule": "constant", "optim.warmup_steps": steps})
        kind = _section(section, "params", path).get("warmup_type", WARMUP_LR_DEFAULTS["warmup_type"])
        if section.get("type") == "WarmupLR" and kind in WARMUP_TYPES:
            found["strategy.deepspeed.warmup_type"] = kind
    return found


def settings_line(path: str) -> str | None:
    """The one line that says which of dptrain's options the ds_config.json at path states, and their values (taken
    into the options where the run left them, or the run's own: check_against_run refuses any other); None where it
    states none."""
    found = file_options(read_user_config(path), path)
    if not found:
        return None
    return f"settings from {path}: " + ", ".join(f"{name} {_shown(value)}" for name, value in found.items())


def _shown(value: Any) -> str:
    """An option's value as the command line takes it (betas 0.8,0.999; grad_clip none)."""
    if value is None:
        return "none"
    if isinstance(value, (tuple, list)):
        return ",".join(f"{item:g}" for item in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _option(cfg: RunConfig, name: str) -> Any:
    value: Any = cfg
    for part in name.split("."):
        value = getattr(value, part)
    return value


def adopt_user_config(cfg: RunConfig, given: Collection[str] | None = None) -> RunConfig:
    """cfg with the ds_config's settings taken into dptrain's options where the run does not set them itself.

    given: the dotted options the user set (in the config file or on the command line); the file's value never
    replaces one of them, and check_against_run refuses a contradiction. None: an option counts as set where its
    value differs from the default (an option set to its default value on purpose then takes the file's)."""
    path = cfg.strategy.deepspeed.config
    if cfg.strategy.name != "deepspeed" or path is None:
        return cfg
    defaults = RunConfig()
    taken = {name: value for name, value in file_options(read_user_config(path), path).items()
             if (name not in given if given is not None else _option(cfg, name) == _option(defaults, name))}
    if not taken:
        return cfg
    tree = to_dict(cfg)
    for name, value in taken.items():
        *sections, key = name.split(".")
        table = tree
        for section in sections:
            table = table[section]
        table[key] = value
    return from_dict(tree)


def check_against_run(tree: dict[str, Any], cfg: RunConfig, world_size: int, on_cpu: bool) -> None:
    """ConfigError naming the first setting of the file that DeepSpeed cannot run here, or that contradicts dptrain's."""
    path = cfg.strategy.deepspeed.config
    assert path is not None
    _check_zero(_section(tree, "zero_optimization", path), cfg.strategy.deepspeed.zero_stage, path)
    _check_precision(tree, on_cpu, path)
    _check_batch(tree, cfg.train.global_batch_size, cfg.train.accumulate_steps, world_size, path)
    if _given(tree, "gradient_clipping") and (tree["gradient_clipping"] or None) != cfg.train.grad_clip:
        ours = "none" if cfg.train.grad_clip is None else cfg.train.grad_clip
        raise ConfigError(f"{path} sets gradient_clipping {tree['gradient_clipping']} but train.grad_clip is {ours}; "
                          f"set --train.grad_clip {tree['gradient_clipping'] or 'none'}, or remove gradient_clipping from the file.")
    if "optimizer" in tree:
        _check_optimizer(_section(tree, "optimizer", path), cfg, path)
    if "scheduler" in tree:  # after the optimizer: a contradicting lr is the optimizer's
        _check_scheduler(_section(tree, "scheduler", path), cfg, path)


def _check_scheduler(section: dict[str, Any], cfg: RunConfig, path: str) -> None:
    """WarmupLR from 0 to optim.lr is dptrain's warm-up with a constant schedule; any other scheduler is refused."""
    kind = section.get("type", "?")
    if kind != "WarmupLR":
        raise ConfigError(f"{path} has a scheduler section ({kind}), but dptrain schedules the learning rate itself "
                          f"(it reads WarmupLR only); remove the section and set optim.schedule and optim.warmup_steps instead.")
    given = _section(section, "params", path)
    # what "auto" stands for: advice to set an option to "auto" could not work
    ours = {"warmup_min_lr": 0, "warmup_max_lr": cfg.optim.lr, "warmup_num_steps": cfg.optim.warmup_steps,
            "warmup_type": cfg.strategy.deepspeed.warmup_type}
    params = {**WARMUP_LR_DEFAULTS, "warmup_max_lr": cfg.optim.lr,
              **{key: ours.get(key) if value == "auto" else value for key, value in given.items()}}
    for key in params:
        if key not in (*WARMUP_LR_DEFAULTS, "warmup_max_lr"):
            raise ConfigError(f"{path} sets scheduler {key}, which dptrain's warm-up does not take (it reads "
                              f"{', '.join((*WARMUP_LR_DEFAULTS, 'warmup_max_lr'))}); remove it.")
    if params["warmup_type"] not in WARMUP_TYPES:
        raise ConfigError(f"{path} sets scheduler warmup_type {json.dumps(params['warmup_type'])}, which is not one of "
                          f"DeepSpeed's (it would rise along its log curve instead); set \"log\" or \"linear\".")
    if params["warmup_type"] != cfg.strategy.deepspeed.warmup_type:
        said = (f"sets scheduler warmup_type {json.dumps(params['warmup_type'])}" if "warmup_type" in given
                else "has scheduler WarmupLR without warmup_type (DeepSpeed's \"log\")")
        raise ConfigError(f"{path} {said}, but strategy.deepspeed.warmup_type is "
                          f"{cfg.strategy.deepspeed.warmup_type}; set --strategy.deepspeed.warmup_type "
                          f"{params['warmup_type']}, or set \"warmup_type\": "
                          f"\"{cfg.strategy.deepspeed.warmup_type}\" in the file.")
    if params["warmup_min_lr"] != 0:
        raise ConfigError(f"{path} sets scheduler warmup_min_lr {json.dumps(params['warmup_min_lr'])}, but dptrain's "
                          f"warm-up starts from 0; set 0, or remove warmup_min_lr from the file.")
    if given.get("warmup_max_lr", "auto") != "auto" and cfg.optim.scale_lr_with != "none":
        raise ConfigError(f"{path} sets scheduler warmup_max_lr {json.dumps(params['warmup_max_lr'])}, a fixed rate, but "
                          f"optim.scale_lr_with {cfg.optim.scale_lr_with} scales optim.lr with the batch; remove "
                          f"warmup_max_lr from the file.")
    if params["warmup_max_lr"] != cfg.optim.lr:
        raise ConfigError(f"{path} sets scheduler warmup_max_lr {json.dumps(params['warmup_max_lr'])} but optim.lr is "
                          f"{cfg.optim.lr}, the rate the warm-up reaches; set --optim.lr {params['warmup_max_lr']}, or "
                          f"remove warmup_max_lr from the file.")
    if params["warmup_num_steps"] != cfg.optim.warmup_steps:
        raise ConfigError(f"{path} sets scheduler warmup_num_steps {json.dumps(params['warmup_num_steps'])} but "
                          f"optim.warmup_steps is {cfg.optim.warmup_steps}; set --optim.warmup_steps "
                          f"{params['warmup_num_steps']}, or remove the scheduler section.")
    if cfg.optim.schedule != "constant":
        raise ConfigError(f"{path} has scheduler WarmupLR, which holds the rate after its warm-up, but optim.schedule is "
                          f"{cfg.optim.schedule}; set --optim.schedule constant, or remove the scheduler section.")


def _check_zero(zero: dict[str, Any], stage: int, path: str) -> None:
    given = zero.get("stage", stage)
    if given not in (0, 1, 2, 3) or isinstance(given, bool):
        raise ConfigError(f"{path} sets zero_optimization.stage {json.dumps(given)}, which is not a ZeRO stage (DeepSpeed has "
                          f"0 to 3, and strategy deepspeed runs 1, 2 and 3); set 1, 2 or 3.")
    if given == 0:
        raise ConfigError(f"{path} sets zero_optimization.stage 0 (no ZeRO), which strategy deepspeed does not run; "
                          f"set 1, 2 or 3, or use --strategy.name ddp for plain data parallelism.")
    if given != stage:
        raise ConfigError(f"{path} sets zero_optimization.stage {given} but strategy.deepspeed.zero_stage is {stage}; "
                          f"set --strategy.deepspeed.zero_stage {given}, or remove the stage from the file.")
    for key, what in OFFLOADS.items():
        device = _section(zero, key, path).get("device", "none") if key in zero else "none"
        if device not in ("none", None):
            needs = ("DeepSpeed's compiled async I/O, and the offloaded state would lie outside dptrain's snapshots"
                     if device == "nvme" else "DeepSpeed's compiled CPU Adam")
            raise ConfigError(f"{path} offloads {what} to {device} (zero_optimization.{key}), which strategy deepspeed does "
                              f"not support (it needs {needs}); remove zero_optimization.{key}.")


def _check_precision(tree: dict[str, Any], on_cpu: bool, path: str) -> None:
    if _enabled(_section(tree, "fp16", path)):
        if on_cpu:
            raise ConfigError(f"{path} enables fp16, which DeepSpeed runs on GPUs only, and this run is on the CPU; "
                              f"remove the fp16 section (--train.bf16 true autocasts to bfloat16 instead).")
        raise ConfigError(f"{path} enables fp16, which strategy deepspeed does not run (its loss scaler skips steps that "
                          f"dptrain's schedule and snapshots count); remove the fp16 section, and use --train.bf16 true "
                          f"for bfloat16 autocast.")
    for name in PRECISION_SECTIONS:
        if _enabled(_section(tree, name, path)):
            raise ConfigError(f"{path} enables {name}, but precision is dptrain's train.bf16 (bfloat16 autocast over "
                              f"float32 weights, as for every strategy); remove the {name} section and use --train.bf16 true.")


def _check_batch(tree: dict[str, Any], global_batch: int, pieces: int, world_size: int, path: str) -> None:
    """DeepSpeed's rule, train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x ranks, with
    dptrain's train.global_batch_size and train.accumulate_steps in the places of the first and the last but one."""
    if _given(tree, "train_batch_size") and tree["train_batch_size"] != global_batch:
        raise ConfigError(f"{path} sets train_batch_size {tree['train_batch_size']} but train.global_batch_size is "
                          f"{global_batch}; set --train.global_batch_size {tree['train_batch_size']}, or remove "
                          f"train_batch_size from the file.")
    if _given(tree, "gradient_accumulation_steps") and tree["gradient_accumulation_steps"] != pieces:
        raise ConfigError(f"{path} sets gradient_accumulation_steps {tree['gradient_accumulation_steps']} but "
                          f"train.accumulate_steps is {pieces}; set --train.accumulate_steps "
                          f"{tree['gradient_accumulation_steps']}, or remove gradient_accumulation_steps from the file.")
    micro = global_batch // (world_size * pieces)
    if _given(tree, "train_micro_batch_size_per_gpu") and tree["train_micro_batch_size_per_gpu"] != micro:
        of = f"{pieces} micro-batches of " if pieces > 1 else ""
        raise ConfigError(f"{path} sets train_micro_batch_size_per_gpu {tree['train_micro_batch_size_per_gpu']}, but each "
                          f"of the {world_size} ranks takes {of}{micro} samples of train.global_batch_size {global_batch}; "
                          f"set --train.global_batch_size "
                          f"{tree['train_micro_batch_size_per_gpu'] * world_size * pieces}, or remove "
                          f"train_micro_batch_size_per_gpu from the file.")


def _check_optimizer(section: dict[str, Any], cfg: RunConfig, path: str) -> None:
    """The file's optimizer is accepted where it is the one [optim] builds; dptrain's is used either way."""
    params = _section(section, "params", path)
    mine = _optimizer_name(section, params)
    if mine is None:
        raise ConfigError(f"{path} asks for optimizer {section.get('type')!r}, which dptrain does not build (it builds sgd, "
                          f"adam and adamw from [optim]); remove the optimizer section and set --optim.name.")
    if mine != cfg.optim.name:
        raise ConfigError(f"{path} asks for optimizer {section['type']} ({mine} in dptrain's terms) but optim.name is "
                          f"{cfg.optim.name}; set --optim.name {mine}, or remove the optimizer section.")
    ours = {key: getattr(cfg.optim, key) for key in OPTIMIZER_PARAMS["sgd" if mine == "sgd" else "adam"]}
    ours = {key: list(value) if isinstance(value, tuple) else value for key, value in ours.items()}
    for key, value in params.items():
        if key in ("torch_adam", "adam_w_mode") or value == "auto":  # how DeepSpeed would build it; dptrain builds it
            continue
        if key not in ours:
            raise ConfigError(f"{path} sets optimizer {key}, which dptrain's {mine} does not take from the file (it takes "
                              f"{', '.join(ours)}, into [optim]); remove it.")
        if key == "lr" and cfg.optim.scale_lr_with != "none":
            raise ConfigError(f"{path} sets optimizer lr {value}, a fixed rate, but optim.scale_lr_with "
                              f"{cfg.optim.scale_lr_with} scales optim.lr with the batch; remove lr from the file.")
        if (list(value) if isinstance(value, (list, tuple)) else value) != ours[key]:
            typed = ",".join(map(str, value)) if isinstance(value, list) else value
            raise ConfigError(f"{path} sets optimizer {key} {json.dumps(value)} but optim.{key} is "
                              f"{json.dumps(ours[key])}; set --optim.{key} {typed}, or remove {key} from the file.")


def engine_config(user: dict[str, Any], zero_stage: int, micro_batches: int = 1) -> dict[str, Any]:
    """What deepspeed.initialize gets: the user's settings (already checked) with dptrain's own put in their place
    (micro_batches: train.accumulate_steps)."""
    config = {key: value for key, value in user.items() if key not in DPTRAIN_KEYS}
    config["zero_optimization"] = {**user.get("zero_optimization", {}), "stage": zero_stage}
    # One optimizer step per global batch, in micro_batches pieces whose last is the boundary (gradient_sync says it).
    # DeepSpeed's micro batch only feeds its sample counters and monitors: backward() sets it to each piece's share.
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=micro_batches)
    config["zero_allow_untested_optimizer"] = True  # dptrain's torch SGD and Adam, which ZeRO runs like any other
    return config
