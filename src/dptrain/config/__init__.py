"""RunConfig: one typed tree of dataclasses, loaded from TOML and dotted CLI overrides.

One job a module: `sections` (RunConfig and its sections, whose field docstrings are the reference of each option;
[strategy] is the strategies' catalog's StrategyConfig, each strategy's table of options in its own folder,
strategies/<name>/options.py), `choices` (the built-in datasets, models and trackers by name, with where each is
implemented),
`slurm` ([slurm] and the GPU lines of sbatch), `reading` (a config file read within bounds; read_toml, the one way
dptrain reads TOML), `codec` (trees and --section.option strings to a RunConfig and back, each value coerced to its
field's type in one place) and `help` (the options as --help lists them); what every option's field shares (one value's
checks, field metadata) is dptrain.option_fields. Checks of one value against its declared type (a `Literal`'s
members, a float's finiteness) live in the codec; checks of a value's range, or of several options together, in each
section's `__post_init__`; checks that need the world size, the dataset size or the torch version live with the
strategies (`dptrain.strategies.registry.check_world()`), which the launcher calls before any worker starts.

What the rest of dptrain uses is importable from `dptrain.config` itself, below.
"""

from __future__ import annotations

from dptrain.config.choices import DATASET_NAMES, MODEL_NAMES, TRACKERS, TrackerChoice
from dptrain.config.codec import (current_name, experiment_name, fixed_at_resume, from_dict, load, read, to_dict,
                                  to_toml, upgraded)
from dptrain.option_fields import is_import_path
from dptrain.config.help import Option, field_docs, options, options_help
from dptrain.config.reading import MAX_CONFIG_BYTES, read_config_text, read_toml
from dptrain.config.sections import (FLOAT32_MAX, FLOAT32_TINY, LEGACY_STRATEGY_KEYS, MAX_TIMEOUT_S, OPTIMIZER_CLASSES,
                                     Augment, CheckpointConfig, DataConfig, LaunchConfig, ModelConfig, OptimConfig,
                                     OutputConfig, RunConfig, TrainConfig)
from dptrain.strategies.catalog import SPECS, StrategyConfig
from dptrain.strategies.spec import Exchange, StrategySpec, Traffic
from dptrain.config.slurm import SlurmConfig, sbatch_gpus
from dptrain.errors import ConfigError

__all__ = [
    "Augment", "CheckpointConfig", "ConfigError", "DATASET_NAMES", "DataConfig",
    "Exchange", "FLOAT32_MAX", "FLOAT32_TINY", "LEGACY_STRATEGY_KEYS",
    "LaunchConfig", "MAX_CONFIG_BYTES", "MAX_TIMEOUT_S", "MODEL_NAMES", "ModelConfig", "OPTIMIZER_CLASSES", "OptimConfig",
    "Option", "OutputConfig", "RunConfig", "SPECS", "SlurmConfig", "StrategyConfig", "StrategySpec",
    "TRACKERS", "TrackerChoice", "TrainConfig", "Traffic",
    "current_name", "experiment_name", "field_docs", "fixed_at_resume", "from_dict",
    "is_import_path", "load", "options", "options_help", "read", "read_config_text", "read_toml", "sbatch_gpus", "to_dict", "to_toml", "upgraded",
]
