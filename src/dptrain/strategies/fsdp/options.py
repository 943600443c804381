"""fsdp's torch-free half: [strategy.fsdp] and its spec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dptrain.option_fields import may_change_at_resume, positive
from dptrain.strategies.spec import Exchange, StrategySpec, Traffic

FloatDtype = Literal["auto", "float32", "bfloat16", "float16"]
"""A floating dtype by torch's name (strategy.DTYPES: torch.<name>), or auto: the parameters' own."""


@dataclass(frozen=True, kw_only=True)
class FSDPOptions:
    """[strategy.fsdp]: FSDP2's resharding and mixed precision."""

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
        positive(self.wrap_min_params, "strategy.fsdp.wrap_min_params")


SPEC = StrategySpec(name="fsdp", about="FSDP2: parameters, gradients and optimizer state sharded", table="fsdp",
                    options=FSDPOptions, traffic=Traffic(
    exchanges=(Exchange("all_gather", "parameters", "forward", "units", dtype="param_dtype"),
               Exchange("all_gather", "parameters", "backward", "units", dtype="param_dtype", when="reshard_after_forward"),
               Exchange("reduce_scatter", "gradients", "backward", "units", dtype="reduce_dtype")),
    sharded=("params", "grads", "optim"), gathers_params=True))
