"""The strategies' torch-free registry: FOLDERS, the one line a strategy adds, and what is built from it: SPECS (name ->
spec), strategy.name's choices, and StrategyConfig, the [strategy] section with a table of options for each strategy
that has its own. The configuration reads it before any torch is imported (each folder's options.py imports none),
as do the measuring lab's scaling model (the traffic) and strategies/registry.py (the classes).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Literal

from dptrain.errors import ConfigError
from dptrain.strategies.spec import StrategySpec

FOLDERS = ("ddp", "fsdp", "zero1", "ps", "dp", "single", "deepspeed", "local_sgd", "diloco")
"""Each strategy's folder, strategies/<name>/ (options.py: SPEC; strategy.py: its class); strategy.name's choices are
in this order, as --help lists them."""

SPECS: dict[str, StrategySpec] = {
    spec.name: spec for spec in (importlib.import_module(f"dptrain.strategies.{folder}.options").SPEC for folder in FOLDERS)}
assert tuple(SPECS) == FOLDERS, "a strategy's folder is named as the strategy"

TABLES: dict[str, type] = {spec.table: spec.options for spec in SPECS.values() if spec.table and spec.options}
"""[strategy.<table>] -> its dataclass of options, for each table a strategy owns."""

StrategyName = Literal[tuple(SPECS)]  # type: ignore[valid-type]  # SPECS' names: the one list of them
"""The strategies' names, as strategy.name takes them."""


def readers_of(table: str) -> tuple[str, ...]:
    """The strategies that read [strategy.<table>]."""
    return tuple(name for name, spec in SPECS.items() if spec.table == table)


class _Strategy:
    """What StrategyConfig adds to its fields: the chosen spec, the tables, the check of options set elsewhere."""

    name: str

    @property
    def spec(self) -> StrategySpec:
        """The chosen strategy's spec."""
        return SPECS[self.name]

    def __post_init__(self) -> None:
        # A table's options belong to the strategies that read it; set for another strategy, those marked
        # REFUSED_ELSEWHERE are refused (the others are left unread, so that one config serves a sweep of strategies).
        for table, options in self.tables().items():
            readers = readers_of(table)
            if self.name in readers:
                continue
            for f in dataclasses.fields(options):  # type: ignore[arg-type]  # every table is a dataclass
                value = getattr(options, f.name)
                if f.metadata.get("refused_elsewhere") and value != f.default:
                    who = " and ".join(readers)
                    who = f"strategy {who}" if len(readers) == 1 else who
                    raise ConfigError(f"strategy.{table}.{f.name} {value} applies to {who} only, not {self.name}; "
                                      f"drop it or use --strategy.name {readers[0]}.")

    def tables(self) -> dict[str, Any]:
        """Table name -> its options, for every strategy that has options of its own."""
        return {table: getattr(self, table) for table in TABLES}


StrategyConfig: Any = dataclass(frozen=True, kw_only=True)(type("StrategyConfig", (_Strategy,), {
    "__module__": __name__,
    "__doc__": "[strategy]: which strategy runs, and each strategy's table of options ([strategy.ddp], ...).",
    "__annotations__": {"name": StrategyName, **TABLES},
    "name": "ddp",
    **{table: field(default_factory=options) for table, options in TABLES.items()},
}))
"""[strategy], made from the catalog: name, and a field of each table (its options class from the strategy's folder)."""
StrategyConfig.FIELD_DOCS = {"name": ", ".join(f"{name} ({spec.about})" for name, spec in SPECS.items()) + "."}
