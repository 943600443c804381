"""single's torch-free half: its spec (no options of its own)."""

from __future__ import annotations

from dptrain.strategies.spec import StrategySpec, Traffic

SPEC = StrategySpec(name="single", about="one process, one device", traffic=Traffic())
