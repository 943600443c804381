"""Every strategy and every DDP comm hook trains the same model as one process, on the defaults.

The defaults include train.channels_last: build() turns the model channels_last, and the
convolutions here have more than one input channel (a 1-channel 3x3 kernel has the same strides
in either layout, so it cannot tell them apart). The optimizers are built by train.optimizer_spec
(Adam fused: its kernel walks a gradient as if laid out like its parameter). The strategy classes
run directly on 2 gloo ranks, every case in one set of rank processes; the one-process reference
runs here, through the same function. Each case runs in float64 and in float32.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain_bench.scaling_model import Plan, Workload, bytes_sent_per_rank
from dptrain.config import OptimConfig, RunConfig, StrategyConfig
from dptrain.strategies.ddp.options import DDPOptions
from dptrain.strategies.ps.options import PSOptions
from dptrain.distributed.env import DistEnv
from dptrain.strategies.registry import build_strategy
from dptrain.train import optimizer_spec
from tests.ranks import run_on_ranks

pytestmark = pytest.mark.slow

WORLD = 2
GLOBAL_BATCH = 16  # 8 per rank; with a dedicated server the one worker takes all 16
IMAGE = (3, 8, 8)
LR = {"sgd": 0.05, "adam": 1e-3}
DTYPES = {"float32": torch.float32, "float64": torch.float64}
STEPS = 3

# Every case: name -> strategy. Exact: the mean gradient over ranks is the one-process gradient up to
# float reassociation. PowerSGD all-reduces plainly until start_powerSGD_iter (2, set in
# comm_hooks.install), so its first 2 steps are exact; its third, compressed, is tested on its own
# (test_powersgd_*), as are fp16 and bf16 (test_compressed_gradient_*).
EXACT = {
    "ddp": StrategyConfig(name="ddp"),
    "ddp-ring": StrategyConfig(name="ddp", ddp=DDPOptions(comm_hook="ring")),
    "zero1": StrategyConfig(name="zero1"),
    "fsdp": StrategyConfig(name="fsdp"),
    "ps": StrategyConfig(name="ps"),
    "ps-dedicated": StrategyConfig(name="ps", ps=PSOptions(dedicated_server=True)),
}
LOSSY = {hook: StrategyConfig(name="ddp", ddp=DDPOptions(comm_hook=hook)) for hook in ("powersgd", "fp16", "bf16")}
# PowerSGD over buckets of 4 KB: about one a tensor, compressed and sent one after the other on the rank's thread
# while backward goes on (comm_hooks.InOrder); interleaved on gloo, their chained all-reduces mismatched.
LOSSY["powersgd-buckets"] = StrategyConfig(name="ddp", ddp=DDPOptions(comm_hook="powersgd", bucket_mb=0.004))
EXACT_STEPS = {"powersgd": 2, "powersgd-buckets": 2, "fp16": 0, "bf16": 0}
# The scaling model (dptrain_bench/scaling_model.py) counts a ring over gloo. ddp's and zero1's gradients and fsdp's collectives go
# through shared memory between ranks of one host, as here, and count what a rank writes there instead; these twins
# send through gloo, as ranks on hosts of their own do, for test_the_scaling_models_bytes_are_what_each_case_counts
# (fsdp-gloo's ranks are told they are alone on their hosts: fsdp has no switch of its own). Once, float32 and SGD.
GLOO = {  # name -> (strategy, whether each rank is told it is alone on its host)
    "ddp-gloo": (StrategyConfig(name="ddp", ddp=DDPOptions(shared_memory=False)), False),
    "zero1-gloo": (StrategyConfig(name="zero1", ddp=DDPOptions(shared_memory=False)), False),
    "fsdp-gloo": (StrategyConfig(name="fsdp"), True),
}
THROUGH_SHARED_MEMORY = ("ddp", "zero1", "fsdp")

# Final weights, max difference relative to each tensor's scale (max |w|). float64: 1e-10, where the
# measured difference is 2e-16 (one rounding of the scale). float32: 1e-5, where the measured
# difference is 1.2e-7 (one ulp of the scale, 2^-23). Why 1e-5 holds on any machine (AVX-512 or
# AVX2 kernels sum in other orders): a gradient element here sums at most 256 products, so its
# reassociation error is at most 256 * 2^-24 = 1.5e-5 of the sum of their magnitudes, and in practice
# about sqrt(256) * 2^-24 = 1e-6; SGD passes that on times lr * (1 + 1.9 + 2.71) over 3 steps with
# momentum 0.9. Adam divides by sqrt(v), which amplifies noise only where |g| is comparable to it:
# the smallest non-zero first-step gradient here is 8e-5 of its tensor's scale, 80x above the noise
# (exact zeros, from ReLUs dead on the whole batch, are zero in every process).
EXACT_BOUND = {"float64": 1e-10, "float32": 1e-5}

# The bug this module was written for: ps with channels_last and fused Adam, before the fix: 1.7e-2
# of conv2's scale after step 1, 4.8e-2 after step 3, in float64 as in float32.


class CNN(nn.Module):
    """A user's CNN: conv 3->8, conv 8->16, two linear layers, no dropout, plain nn.Flatten."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                                      nn.MaxPool2d(2), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(16 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def initial_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return CNN().to(dtype).to(memory_format=torch.channels_last)  # as train.build_trainer() on the default channels_last


def batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step `step` (from 0), the same in every process, NHWC as the loader gives it."""
    gen = torch.Generator().manual_seed(100 + step)
    images = torch.randn(GLOBAL_BATCH, *IMAGE, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
    return images, torch.randint(0, 10, (GLOBAL_BATCH,), generator=gen)


def train(cfg: StrategyConfig, env: DistEnv, optim: str, dtype: torch.dtype, steps: int) -> dict[str, list]:
    """On rank 0: the whole model after each step, and each step's gradients as the optimizer sees them (ddp); on
    every rank: the bytes the strategy counts as sent in each step (comm_bytes, the worker's comm_bytes_per_step).

    As train.build_trainer() and TrainStep.eager() do it: the seeded model, channels_last, wrapped by the
    strategy; the optimizer from optimizer_spec; this rank's share of each global batch; backward
    through the strategy.
    """
    strategy = build_strategy(cfg, env, torch.device("cpu"))
    wrapped = strategy.wrap(initial_model(dtype))
    run_cfg = RunConfig(optim=OptimConfig(name=optim, lr=LR[optim]), strategy=cfg)  # type: ignore[arg-type]
    optimizer = strategy.build_optimizer(strategy.eval_module, optimizer_spec(run_cfg))
    index, share_count = strategy.data_share()
    out: dict[str, list] = {"weights": [], "grads": [], "comm_bytes": []}
    for step in range(steps):
        images, labels = batch(step, dtype)
        share = slice(0, 0) if index is None else slice(index, None, share_count)  # a dedicated server takes none
        optimizer.zero_grad(set_to_none=True)
        loss_sum = F.cross_entropy(wrapped(images[share]), labels[share], reduction="sum")
        strategy.backward(loss_sum, GLOBAL_BATCH)
        if cfg.name == "ddp":  # synchronised by now: what the hook produced
            out["grads"].append({n: p.grad.detach().clone() for n, p in strategy.eval_module.named_parameters()})
        optimizer.step()
        out["comm_bytes"].append(strategy.comm_bytes(1))
        out["weights"].append({k: v.detach().clone() for k, v in strategy.full_state_dict().items()})
    return out


def _all_cases(rank: int, world: int) -> bytes:
    torch.set_num_threads(1)
    env = DistEnv(rank, rank, world, world, "127.0.0.1", 0, "torchrun")
    results = {(name, optim, dtype_name): train(cfg, env, optim, dtype, STEPS)
               for dtype_name, dtype in DTYPES.items() for optim in LR for name, cfg in {**EXACT, **LOSSY}.items()}
    alone = DistEnv(rank, 0, world, 1, "127.0.0.1", 0, "torchrun")
    for name, (cfg, on_own_host) in GLOO.items():
        results[(name, "sgd", "float32")] = train(cfg, alone if on_own_host else env, "sgd", torch.float32, STEPS)
    buffer = io.BytesIO()  # bytes: a tensor put on the queue is a shared-memory handle, gone when this process exits
    torch.save(results if rank == 0 else {key: result["comm_bytes"] for key, result in results.items()}, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def ranks():
    """(case, optim, dtype) -> train() on 2 ranks, rank 0's view, but for comm_bytes: each step's, of every rank."""
    rank0, rank1 = (torch.load(io.BytesIO(out)) for out in run_on_ranks(_all_cases, WORLD, timeout=300))
    for key, result in rank0.items():
        result["comm_bytes"] = list(zip(result["comm_bytes"], rank1[key]))
    return rank0


@pytest.fixture(scope="module")
def one_process():
    """(optim, dtype) -> train() in this one process (ddp on one process: the bare model)."""
    made: dict[tuple[str, str], dict[str, list]] = {}

    def get(optim: str, dtype_name: str) -> dict[str, list]:
        if (optim, dtype_name) not in made:
            made[(optim, dtype_name)] = train(StrategyConfig(name="ddp"), DistEnv.single(), optim, DTYPES[dtype_name], STEPS)
        return made[(optim, dtype_name)]

    return get


def worst(tensors: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest difference in a tensor relative to its scale (max |t|), and that tensor's name."""
    assert tensors.keys() == reference.keys()
    diffs = {name: ((tensors[name] - ref).abs().max() / ref.abs().max()).item() for name, ref in reference.items()}
    name = max(diffs, key=diffs.__getitem__)
    return diffs[name], name


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("optim", list(LR))
@pytest.mark.parametrize("name", [*EXACT, "powersgd", "powersgd-buckets"])
def test_strategy_trains_what_one_process_trains(ranks, one_process, name, optim, dtype_name):
    steps = EXACT_STEPS.get(name, STEPS)
    weights, reference = ranks[(name, optim, dtype_name)]["weights"], one_process(optim, dtype_name)["weights"]
    for step in range(steps):
        diff, tensor = worst(weights[step], reference[step])
        assert diff <= EXACT_BOUND[dtype_name], f"after step {step + 1}, {tensor} differs by {diff:.2e} of its scale"


# fp16 and bf16, first step: each rank r rounds its gradient g_r to the format and halves it (exact
# in a binary format, but for fp16's subnormals), and the all-reduce rounds the sum once more. With
# unit roundoff u (2^-11 for fp16's 11 significant bits, 2^-8 for bf16's 8) the result is within
# u |g_0 + g_1| / 2 (1 + u) + u (|g_0| + |g_1|) / 2 of the exact mean, which is at most
# u (|g_0| + |g_1|) (1 + u), elementwise, plus 4 fp16 subnormal half-spacings (2^-25 each) where
# fp16 underflows. Measured: up to 0.91 of this bound. The gradients g_r are recomputed here.
UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("hook", list(UNIT_ROUNDOFF))
def test_compressed_gradient_is_the_mean_within_the_formats_rounding(ranks, hook, dtype_name):
    dtype, u = DTYPES[dtype_name], UNIT_ROUNDOFF[hook]
    model = initial_model(dtype)
    images, labels = batch(0, dtype)
    local = []
    for rank in range(WORLD):  # what each rank's backward gives, before the hook: scaled by world / global count
        model.zero_grad()
        (F.cross_entropy(model(images[rank::WORLD]), labels[rank::WORLD], reduction="sum") * (WORLD / GLOBAL_BATCH)).backward()
        local.append({n: p.grad.clone() for n, p in model.named_parameters()})
    slack = EXACT_BOUND[dtype_name]  # of the scale: these g_r are computed with other threads than the ranks'
    for optim in LR:
        grads = ranks[(hook, optim, dtype_name)]["grads"][0]
        for name, got in grads.items():
            g0, g1 = local[0][name], local[1][name]
            mean = (g0 + g1) / 2
            bound = u * (g0.abs() + g1.abs()) * (1 + u) + 4 * 2.0**-25 + slack * mean.abs().max()
            excess = ((got - mean).abs() - bound).max().item()
            assert excess <= 0, f"{hook} {optim} {name}: {excess:.2e} beyond the rounding bound"
        assert max(worst(grads, {n: (local[0][n] + local[1][n]) / 2 for n in grads})[0], 0) > 1e-6  # it did round


# PowerSGD's third step, its first compressed one (the error feedback is still zero): each gradient
# matrix it compresses (those where rank 4 saves 2x: conv2 and the first linear layer) becomes P P^T G,
# G the mean gradient and P orthonormal, an orthogonal projection: |G - A|^2 + |A|^2 = |G|^2 up to
# rounding (measured 1e-16 of |G|^2 in float64, 1e-7 in float32); the other tensors are all-reduced
# as they are, exactly. The layout does not change the norms: channels_last gradient memory is a
# column permutation of the logical matrix, and PowerSGD compresses that matrix.
PYTHAGORAS_BOUND = {"float64": 1e-10, "float32": 1e-5}


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("optim", list(LR))
@pytest.mark.parametrize("case", ["powersgd", "powersgd-buckets"])
def test_powersgd_projects_the_mean_gradient(ranks, one_process, case, optim, dtype_name):
    step, rank = EXACT_STEPS[case], StrategyConfig().ddp.powersgd_rank
    got = ranks[(case, optim, dtype_name)]["grads"][step]
    exact = one_process(optim, dtype_name)["grads"][step]  # at the same weights: the first 2 steps were exact
    compressed = []
    for name, g in exact.items():
        a = got[name]
        n, m = g.shape[0], g.numel() // g.shape[0]
        if g.dim() > 1 and (n + m) * rank * 2 < n * m:  # PowerSGD's _should_compress, min_compression_rate 2
            compressed.append(name)
            g2, a2, r2 = (g.double() ** 2).sum(), (a.double() ** 2).sum(), ((g - a).double() ** 2).sum()
            assert abs(r2 + a2 - g2) <= PYTHAGORAS_BOUND[dtype_name] * g2, f"{name}: not a projection"
            assert r2 > 1e-4 * g2, f"{name}: not compressed"
        else:
            diff = ((a - g).abs().max() / g.abs().max()).item()
            assert diff <= EXACT_BOUND[dtype_name], f"{name}: all-reduced, yet {diff:.2e} from the mean"
    assert compressed == ["features.2.weight", "head.0.weight"]


def model_bytes(cfg: StrategyConfig, dtype: torch.dtype, compressed: bool) -> float:
    """What the scaling model says the busiest rank sends in a step of this case: the CNN's parameters in `dtype`, its
    weight matrices for PowerSGD (compressed: from its third step on; before, it all-reduces plainly)."""
    params = list(initial_model(dtype).parameters())
    element = params[0].element_size()  # the model's fp16 and bf16 rule halves it: 4 bytes in float32, 8 in float64
    work = Workload(param_bytes=float(sum(p.numel() for p in params) * element), element_size=element,
                    global_batch=GLOBAL_BATCH, compute_s_per_sample=0.0, fsdp_units=2,  # block: features, head
                    matrices=tuple((p.shape[0], p.numel() // p.shape[0]) for p in params if p.dim() > 1))
    hook = "allreduce" if cfg.ddp.comm_hook == "powersgd" and not compressed else cfg.ddp.comm_hook
    plan = Plan(strategy=cfg.name, comm_hook=hook, powersgd_rank=cfg.ddp.powersgd_rank,
                reshard_after_forward=cfg.fsdp.reshard_after_forward)
    return bytes_sent_per_rank(plan, work, WORLD)


@pytest.mark.parametrize("name", [*(n for n in EXACT if n not in THROUGH_SHARED_MEMORY), *LOSSY, *GLOO])
def test_the_scaling_models_bytes_are_what_each_case_counts(ranks, name):
    """Every strategy and hook on 2 ranks, each step: the busiest rank's count is the model's bytes_sent_per_rank."""
    cfg = GLOO[name][0] if name in GLOO else {**EXACT, **LOSSY}[name]
    cases = [key for key in ranks if key[0] == name]
    assert cases
    for _, optim, dtype_name in cases:
        counted = ranks[(name, optim, dtype_name)]["comm_bytes"]
        plain = EXACT_STEPS["powersgd"]  # PowerSGD's steps before start_powerSGD_iter; the other hooks ignore the flag
        expected = [model_bytes(cfg, DTYPES[dtype_name], compressed=step >= plain) for step in range(STEPS)]
        assert [max(per_rank) for per_rank in counted] == expected, (optim, dtype_name, counted)
        assert all(sent > 0 for per_rank in counted for sent in per_rank)  # every rank sends in every step


def test_the_cases_through_shared_memory_count_what_they_write_there(ranks):
    """Why ddp, zero1 and fsdp are compared with the model through their gloo twins: on one host they count another
    transport's bytes (docs/strategies.md), here more than the ring's, which their twins count."""
    for name in THROUGH_SHARED_MEMORY:
        shared, gloo = (ranks[(case, "sgd", "float32")]["comm_bytes"] for case in (name, f"{name}-gloo"))
        assert all(max(s) > max(g) for s, g in zip(shared, gloo)), (name, shared, gloo)
