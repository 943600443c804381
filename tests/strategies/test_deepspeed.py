"""strategy.name = "deepspeed": ZeRO 1, 2 and 3 train what one process trains, resume bit for bit, keep snapshots
plain data, and refuse a ds_config.json that contradicts the run (or that DeepSpeed cannot run here) in one sentence.

The equivalence runs the strategy class directly on 2 gloo ranks, as tests/strategies/test_parity.py does (its model:
convolutions with 3 and 8 input channels, channels_last, fused Adam from train.optimizer_spec), with dptrain's
learning-rate schedule on the optimizer build_optimizer returns; every case in one set of rank processes.
"""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dptrain import snapshots
from dptrain.cli import main
from dptrain.config import OptimConfig, RunConfig, StrategyConfig, TrainConfig, load as load_config
from dptrain.strategies.deepspeed.options import DeepSpeedOptions
from dptrain.distributed.env import DistEnv
from dptrain.errors import ConfigError
from dptrain.schedule import build_scheduler
from dptrain.strategies.registry import build_strategy, check_world
from dptrain.strategies.deepspeed.ds_config import engine_config
from dptrain.train import optimizer_spec
from tests.conftest import read_events
from tests.ranks import run_cli_on_ranks, run_on_ranks
from tests.strategies.test_parity import GLOBAL_BATCH, LR, WORLD, batch, initial_model, worst
from tests.test_safe_load import Planted, rehash

STEPS = 3

# ---------------------------------------------------------------- the ds_config.json, checked before any worker starts


def run_config(tmp_path: Path, ds: dict | str | None, *overrides: tuple[str, str]) -> RunConfig:
    """A deepspeed run's config; ds: the JSON's settings (a str is written as it is), None for no file."""
    pairs = [("strategy.name", "deepspeed"), *overrides]
    if ds is not None:
        path = tmp_path / "ds_config.json"
        path.write_text(ds if isinstance(ds, str) else json.dumps(ds))
        pairs.append(("strategy.deepspeed.config", str(path)))
    return load_config(None, pairs)


def refusal(cfg: RunConfig, on_cpu: bool = True) -> str:
    with pytest.raises(ConfigError) as caught:
        check_world(cfg, 2, 1000, on_cpu=on_cpu)
    return str(caught.value)


HOSTILE = {  # name -> (the file's settings, the options, a fragment of the one sentence)
    "invalid JSON": ('{"zero_optimization": {"stage": 2,}}', (), r"is not valid JSON \(Expecting property name enclosed in double quotes at line 1, column 35\); fix the file\."),
    "not an object": ("[1, 2]", (), "holds a JSON list, not an object of DeepSpeed settings"),
    "fp16 on the CPU": ({"fp16": {"enabled": True}}, (), "enables fp16, which DeepSpeed runs on GPUs only, and this run is on the CPU; remove the fp16 section"),
    "zero stage 4": ({"zero_optimization": {"stage": 4}}, (), "sets zero_optimization.stage 4, which is not a ZeRO stage \\(DeepSpeed has 0 to 3"),
    "zero stage 0": ({"zero_optimization": {"stage": 0}}, (), "stage 0 \\(no ZeRO\\), which strategy deepspeed does not run; set 1, 2 or 3, or use --strategy.name ddp"),
    "offload to nvme": ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}},
                        (("strategy.deepspeed.zero_stage", "3"),), "offloads the parameters to nvme \\(zero_optimization.offload_param\\), which strategy deepspeed does not support \\(it needs DeepSpeed's compiled async I/O"),
    "offload to the CPU": ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, (), "offloads the optimizer state to cpu \\(zero_optimization.offload_optimizer\\), which strategy deepspeed does not support \\(it needs DeepSpeed's compiled CPU Adam\\)"),
    "another stage": ({"zero_optimization": {"stage": 3}}, (), "sets zero_optimization.stage 3 but strategy.deepspeed.zero_stage is 2; set --strategy.deepspeed.zero_stage 3, or remove"),
    "another batch": ({"train_batch_size": 64}, (), "sets train_batch_size 64 but train.global_batch_size is 128; set --train.global_batch_size 64, or remove"),
    "another micro batch": ({"train_micro_batch_size_per_gpu": 16}, (), "sets train_micro_batch_size_per_gpu 16, but each of the 2 ranks takes 64 samples of train.global_batch_size 128; set --train.global_batch_size 32"),
    "another accumulation": ({"gradient_accumulation_steps": 4}, (("train.accumulate_steps", "2"),), "sets gradient_accumulation_steps 4 but train.accumulate_steps is 2; set --train.accumulate_steps 4, or remove gradient_accumulation_steps from the file\\.$"),
    "another micro batch of accumulation": ({"train_micro_batch_size_per_gpu": 16}, (("train.accumulate_steps", "2"),), "but each of the 2 ranks takes 2 micro-batches of 32 samples of train.global_batch_size 128; set --train.global_batch_size 64, or remove"),
    "another clip": ({"gradient_clipping": 1.0}, (), "sets gradient_clipping 1.0 but train.grad_clip is none; set --train.grad_clip 1.0, or remove"),
    "a scheduler": ({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}}, (), "has a scheduler section \\(OneCycle\\), but dptrain schedules the learning rate itself \\(it reads WarmupLR only\\)"),
    "DeepSpeed's Adam is AdamW": ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}, (), "asks for optimizer Adam \\(adamw in dptrain's terms\\) but optim.name is adam; set --optim.name adamw"),
    "another lr": ({"optimizer": {"type": "Adam", "params": {"lr": 5e-4, "adam_w_mode": False}}}, (), "sets optimizer lr 0.0005 but optim.lr is 0.001; set --optim.lr 0.0005, or remove lr"),
    "other betas": ({"optimizer": {"type": "Adam", "params": {"betas": [0.8, 0.999], "adam_w_mode": False}}}, (), "sets optimizer betas \\[0.8, 0.999\\] but optim.betas is \\[0.9, 0.999\\]; set --optim.betas 0.8,0.999, or remove betas from the file\\."),
    "another optimizer": ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, (), "asks for optimizer 'Lamb', which dptrain does not build"),
    "bf16 weights": ({"bf16": {"enabled": True}}, (("train.bf16", "true"),), "enables bf16, but precision is dptrain's train.bf16 \\(bfloat16 autocast over float32 weights"),
    # NaN was refused with advice to pass --train.grad_clip nan; Python's json reads NaN, Infinity and 1e400 as floats.
    "NaN clipping": ('{"gradient_clipping": NaN}', (), r"holds the number NaN, which is not finite; put a finite number in the file there, or remove that setting\.$"),
    "infinite lr": ('{"optimizer": {"type": "Adam", "params": {"lr": -Infinity}}}', (), r"holds the number -Infinity, which is not finite"),
    "1e400": ('{"gradient_clipping": 1e400}', (), r"holds the number 1e400, which is not finite"),
    # json's RecursionError (a traceback) and Python's ValueError for integers of over 4,300 digits.
    "deep nesting": ("[" * 3000 + "]" * 3000, (), r"nests brackets more than 32 deep, far more than a config needs; fix the file\.$"),
    "a huge integer": ('{"train_batch_size": ' + "1" * 5000 + "}", (), r"has a key or number longer than 100 characters; fix the file\.$"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_ds_config_that_cannot_run_here_or_contradicts_the_run_is_one_sentence(tmp_path, case):
    ds, overrides, fragment = HOSTILE[case]
    message = refusal(run_config(tmp_path, ds, *overrides))
    assert re.search(fragment, message), message
    assert message.count(". ") == 0 and message.endswith(".") and "\n" not in message, message


def test_a_missing_or_unreadable_file_is_one_sentence(tmp_path):
    missing = load_config(None, [("strategy.name", "deepspeed"), ("strategy.deepspeed.config", str(tmp_path / "nope.json"))])
    assert refusal(missing) == (f"strategy.deepspeed.config {tmp_path / 'nope.json'} does not exist; check the path, "
                                f"or leave the option out for DeepSpeed's defaults.")
    folder = load_config(None, [("strategy.name", "deepspeed"), ("strategy.deepspeed.config", str(tmp_path))])
    assert refusal(folder) == f"strategy.deepspeed.config {tmp_path} is a directory, not a file; give the path of the file."
    # /dev/zero was read without a bound (7 GB before a MemoryError under a cap).
    endless = load_config(None, [("strategy.name", "deepspeed"), ("strategy.deepspeed.config", "/dev/zero")])
    assert refusal(endless) == ("strategy.deepspeed.config /dev/zero is a character device, not a regular file; "
                                "check that the path names the right file.")
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x80\x02}q\x00")
    wrong = load_config(None, [("strategy.name", "deepspeed"), ("strategy.deepspeed.config", str(binary))])
    assert refusal(wrong) == (f"strategy.deepspeed.config {binary} is not UTF-8 text (byte 0 is 0x80; a binary file?); "
                              f"check that the path names the right file.")


def test_fp16_on_a_gpu_is_refused_too(tmp_path):
    assert "enables fp16, which strategy deepspeed does not run" in refusal(run_config(tmp_path, {"fp16": {"enabled": True}}), on_cpu=False)


def test_a_file_that_repeats_the_run_is_accepted_and_its_own_settings_kept(tmp_path):
    """The seed's kind of ds_config.json, stating dptrain's settings again (or "auto", Hugging Face's placeholder)."""
    ds = {"train_batch_size": 128, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
          "gradient_clipping": 0.5, "fp16": {"enabled": False}, "bf16": {"enabled": "auto"},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0,
                                                   "adam_w_mode": False, "torch_adam": True}},
          "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": 5e5}, "steps_per_print": 100}
    cfg = run_config(tmp_path, ds, ("strategy.deepspeed.zero_stage", "3"), ("train.grad_clip", "0.5"))
    check_world(cfg, 2, 1000, on_cpu=True)
    assert engine_config(ds, 3) == {
        "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": 5e5}, "steps_per_print": 100,
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True}


def test_the_deepspeed_options_belong_to_strategy_deepspeed():
    with pytest.raises(ConfigError, match="strategy.deepspeed.zero_stage 3 applies to strategy deepspeed only, not ddp"):
        StrategyConfig(deepspeed=DeepSpeedOptions(zero_stage=3))
    with pytest.raises(ConfigError, match="strategy.deepspeed.config ds_config.json applies to strategy deepspeed only, not fsdp"):
        StrategyConfig(name="fsdp", deepspeed=DeepSpeedOptions(config="ds_config.json"))


def test_without_deepspeed_installed_train_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    import dptrain.strategies.deepspeed.strategy as module

    real = module.importlib.util.find_spec
    monkeypatch.setattr(module.importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    code = main(["train", "--strategy.name", "deepspeed", "--data.name", "synthetic", "--output.dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["dptrain: error: strategy deepspeed needs DeepSpeed, which is not installed here; run pip "
                                 "install 'dptrain[deepspeed]', or use --strategy.name fsdp or zero1 for ZeRO without it."]
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---------------------------------------------------------------- ZeRO 1, 2 and 3 on 2 ranks train what one process trains

# name -> (ZeRO stage, optimizer, schedule, grad_clip). cosine with a 1-step warm-up: the rate changes every step
# (the first runs at 0), so each step checks that build_optimizer's optimizer hands the schedule's rate on;
# onecycle moves SGD's momentum too. Clipped: SGD (Adam's update hardly changes when every gradient is scaled by
# one factor), with a bound below every step's gradient norm here (0.46 to 0.52).
CASES = {
    **{f"zero{stage}-{optim}": (stage, optim, "cosine", None) for stage in (1, 2, 3) for optim in ("sgd", "adam")},
    "zero1-sgd-onecycle": (1, "sgd", "onecycle", None),
    **{f"zero{stage}-sgd-clipped": (stage, "sgd", "cosine", 0.1) for stage in (2, 3)},
}

# float32 only: DeepSpeed reduces gradients in float32 at best (communication_data_type has no fp64) and keeps
# float32 master weights, so a float64 model trains in float32 (measured: 1.2e-7 to 2.2e-7 of a tensor's scale from
# float64 one-process training after 3 steps, one float32 rounding). In float32 the bound is test_parity's
# EXACT_BOUND["float32"], 1e-5 of each tensor's scale, and its argument holds here unchanged: the 2 ranks'
# gradients reach the update through one more float32 sum (DeepSpeed averages the reduced sum by 1/2, exact) and
# differ from one process's by float reassociation only; DeepSpeed's clipping multiplies by max_norm / (norm + 1e-6)
# as torch does. Measured: at most 7.8e-8 (SGD) and 1.2e-7 (Adam) of the scale.
BOUND = 1e-5


def run_cfg(optim: str, schedule: str, grad_clip: float | None, stage: int = 2) -> RunConfig:
    return RunConfig(optim=OptimConfig(name=optim, lr=LR[optim], schedule=schedule, warmup_steps=1),  # type: ignore[arg-type]
                     train=TrainConfig(global_batch_size=GLOBAL_BATCH, grad_clip=grad_clip),
                     strategy=StrategyConfig(name="deepspeed", deepspeed=DeepSpeedOptions(zero_stage=stage)) if stage else StrategyConfig(name="ddp"))


def train(cfg: RunConfig, env: DistEnv) -> dict:
    """As train.build_trainer() and TrainStep.eager() do it: the whole model after each step, the logits of the evaluation
    module on the last batch, and what memory_bytes() counts."""
    strategy = build_strategy(cfg.strategy, env, torch.device("cpu"))
    wrapped = strategy.wrap(initial_model(torch.float32))
    optimizer = strategy.build_optimizer(strategy.eval_module, optimizer_spec(cfg))
    scheduler = build_scheduler(cfg, optimizer, STEPS, STEPS)
    index, share_count = strategy.data_share()
    out: dict = {"weights": []}
    for step in range(STEPS):
        images, labels = batch(step, torch.float32)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = F.cross_entropy(wrapped(images[index::share_count]), labels[index::share_count], reduction="sum")
        strategy.backward(loss_sum, GLOBAL_BATCH)
        if cfg.train.grad_clip is not None:
            strategy.clip_grad_norm(wrapped, cfg.train.grad_clip)
        optimizer.step()
        scheduler.step()
        out["weights"].append({k: v.detach().clone() for k, v in strategy.full_state_dict().items()})  # one process: the live tensors
    strategy.eval_module.eval()
    with torch.no_grad():  # what evaluate() calls: the bare module (ZeRO-3 gathers its parameters in hooks)
        out["logits"] = strategy.eval_module(batch(STEPS, torch.float32)[0]).clone()
    out["memory"] = strategy.memory_bytes(optimizer)
    return out


def _all_cases(rank: int, world: int) -> bytes:
    torch.set_num_threads(1)
    env = DistEnv(rank, rank, world, world, "127.0.0.1", 0, "torchrun")
    results = {name: train(run_cfg(optim, schedule, clip, stage), env) for name, (stage, optim, schedule, clip) in CASES.items()}
    buffer = io.BytesIO()  # bytes: a tensor put on the queue is a shared-memory handle, gone when this process exits
    torch.save(results, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def ranks():
    """case -> train() on 2 ranks, each rank's view."""
    return [torch.load(io.BytesIO(data)) for data in run_on_ranks(_all_cases, WORLD, timeout=120)]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_zero_on_2_ranks_trains_what_one_process_trains(ranks, case):
    stage, optim, schedule, clip = CASES[case]
    reference = train(run_cfg(optim, schedule, clip, stage=0), DistEnv.single())  # ddp on one process: the bare model
    for step in range(STEPS):
        for rank in range(WORLD):
            diff, tensor = worst(ranks[rank][case]["weights"][step], reference["weights"][step])
            assert diff <= BOUND, f"rank {rank}, after step {step + 1}: {tensor} differs by {diff:.2e} of its scale"
    logits = ranks[0][case]["logits"]
    assert ((logits - reference["logits"]).abs().max() / reference["logits"].abs().max()).item() <= BOUND
    if clip is not None:  # and the bound did clip
        unclipped = train(run_cfg(optim, schedule, None, stage=0), DistEnv.single())
        assert worst(unclipped["weights"][-1], reference["weights"][-1])[0] > 100 * BOUND


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_rank_holds_its_share_of_the_optimizer_and_with_zero3_of_the_parameters(ranks, stage):
    """Adam: float32 master weights and two moments, 3 copies of the parameters over 2 ranks (ZeRO pads a partition
    to its alignment: within 1 %)."""
    param_bytes = sum(t.numel() * 4 for t in ranks[0][f"zero{stage}-adam"]["weights"][-1].values())
    for rank in range(WORLD):
        memory = ranks[rank][f"zero{stage}-adam"]["memory"]
        assert memory["optim"] == pytest.approx(3 * param_bytes / WORLD, rel=0.01)
        assert memory["params"] == pytest.approx(param_bytes / WORLD if stage == 3 else param_bytes, rel=0.01)


# ---------------------------------------------------------------- snapshots: exact resume, plain data, refusals

RUN = ["--data.name", "synthetic", "--data.synthetic_train_size", "256", "--data.synthetic_test_size", "64",
       "--train.global_batch_size", "32", "--train.epochs", "2", "--train.max_steps", "10", "--train.log_every", "1",
       "--checkpoint.every_steps", "4", "--checkpoint.keep_last", "5", "--strategy.name", "deepspeed", "--launch.timeout_s", "60"]
RESUMED_AT = 4  # within the first epoch of 8 steps; dropout draws from every rank's RNG stream


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """stage -> (the run never stopped, the run resumed from its snapshot of step 4), both on 2 ranks."""
    root = tmp_path_factory.mktemp("deepspeed")
    made: dict[int, tuple[Path, Path]] = {}

    def get(stage: int) -> tuple[Path, Path]:
        if stage not in made:
            whole, resumed_ = root / f"zero{stage}-whole", root / f"zero{stage}-resumed"
            args = [*RUN, "--strategy.deepspeed.zero_stage", str(stage)]
            assert run_cli_on_ranks(2, [["train", *args, "--output.dir", str(whole)]], str(root), timeout=60) == [0]
            snapshot = whole / "checkpoints" / f"step-{RESUMED_AT:08d}"
            resume = ["train", *args, "--output.dir", str(resumed_), "--train.resume", str(snapshot)]
            assert run_cli_on_ranks(2, [resume], str(root), timeout=60) == [0]
            made[stage] = (whole, resumed_)
        return made[stage]

    return get


# Stage 2's snapshot holds what stage 1's does (the optimizer's partitions; stage 2 partitions the gradients too, which
# no snapshot holds): its resume is in the nightly tier.
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, pytest.param(2, marks=pytest.mark.nightly), 3])
def test_a_resumed_run_ends_bit_identical_to_one_never_stopped(resumed, stage):
    whole, resumed_ = resumed(stage)
    losses = {run: [e["loss"] for e in read_events(run, "step")] for run in (whole, resumed_)}
    assert losses[resumed_] == losses[whole][RESUMED_AT:]
    weights, again = torch.load(whole / "model.pt"), torch.load(resumed_ / "model.pt")
    assert weights.keys() == again.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, again[name]), name
    snapshot = whole / "checkpoints" / f"step-{RESUMED_AT:08d}"
    assert not list(snapshot.glob("*.py")), "DeepSpeed's recovery scripts are not kept"
    assert {p.name for p in (snapshot / "deepspeed").iterdir()} == {
        *(f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in range(2) for kind in ("optim", "model") if kind == "optim" or stage == 3),
        *(["mp_rank_00_model_states.pt"] if stage != 3 else [])}


def snapshot_copy(resumed, tmp_path: Path) -> Path:
    """A copy of the ZeRO-3 run's snapshot of step 4, in a copy of its run folder (eval reads its config.toml)."""
    whole, _ = resumed(3)
    run_dir = tmp_path / "run"
    shutil.copytree(whole, run_dir)
    return run_dir / "checkpoints" / f"step-{RESUMED_AT:08d}"


@pytest.mark.slow
def test_eval_reads_the_whole_model_of_a_zero3_snapshot(resumed, tmp_path, capsys):
    snapshot = snapshot_copy(resumed, tmp_path)
    assert main(["eval", "--checkpoint", str(snapshot)]) == 0, capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("rehashed", [True, False], ids=["manifest re-hashed", "manifest as written"])
def test_a_pickle_planted_in_deepspeeds_files_never_runs(resumed, tmp_path, capsys, rehashed):
    snapshot = snapshot_copy(resumed, tmp_path)
    marker = tmp_path / "pwned"
    target = snapshot / "deepspeed" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": Planted(marker), "ds_version": Planted(marker)}, target)
    if rehashed:
        rehash(snapshot)
    args = [*RUN, "--strategy.deepspeed.zero_stage", "3", "--output.dir", str(tmp_path / "again"), "--train.resume", str(snapshot)]
    codes = [main(["train", *args]), main(["eval", "--checkpoint", str(snapshot)])]
    errors = capsys.readouterr().err.strip().splitlines()
    assert not marker.exists(), "the planted pickle ran"
    assert codes == [2, 2] and len(errors) == 2, errors
    for err in errors:
        assert err.startswith("dptrain: error: ") and "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt" in err, err
        if rehashed:
            assert "could run code on load" in err and "it is not read" in err, err
        else:
            assert "size or sha256 differs from the manifest" in err, err


@pytest.mark.slow
def test_a_snapshot_resumes_at_its_own_world_size_only(resumed, tmp_path, capsys):
    snapshot = snapshot_copy(resumed, tmp_path)
    args = [*RUN, "--strategy.deepspeed.zero_stage", "3", "--output.dir", str(tmp_path / "again"), "--train.resume", str(snapshot)]
    assert main(["train", *args, "--nproc-per-node", "1"]) == 1  # refused by the worker, which picks the snapshot
    assert capsys.readouterr().err.strip().splitlines() == [
        f"dptrain: error: rank 0 failed during resume: snapshot {snapshot} holds the state of strategy deepspeed partitioned over 2 processes, and it "
        f"resumes on as many only, not on 1; run on 2 processes, or use another --output.dir to start afresh."]


def test_a_changed_ds_config_refuses_the_resume(tmp_path):
    """What the file says is part of the computation (the manifest holds its digest); where it lies is not."""
    first = run_config(tmp_path, {"zero_optimization": {"reduce_bucket_size": 5e8}})
    manifest = {"model": first.model.name, "strategy": "deepspeed", "config_hash": snapshots.config_hash(first),
                "config": snapshots.computation_options(first)}
    moved = tmp_path / "moved.json"
    shutil.copy(first.strategy.deepspeed.config, moved)
    snapshots.check_compatible(manifest, load_config(None, [("strategy.name", "deepspeed"), ("strategy.deepspeed.config", str(moved))]),
                                tmp_path, 10)
    moved.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 5e7}}))
    with pytest.raises(ConfigError, match=r"was written with strategy.deepspeed.config \(sha256 of its settings\) = '[0-9a-f]{16}' "
                                          r"but this run has '[0-9a-f]{16}'"):
        snapshots.check_compatible(manifest, load_config(None, [("strategy.name", "deepspeed"), ("strategy.deepspeed.config", str(moved))]),
                                    tmp_path, 10)
