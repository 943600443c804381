"""The strategies: how the model is replicated and kept in sync, each in a folder of its own.

    strategies/<name>/options.py   its torch-free half: SPEC (name, table of options, rules, traffic) and the table,
                                   which the configuration reads before torch is imported
    strategies/<name>/strategy.py  its torch half: a Strategy subclass, registered by being defined
    catalog.py                     FOLDERS, the one registry line a strategy adds; SPECS and StrategyConfig from it
    registry.py                    STRATEGIES (name -> class), build_strategy, check_world: torch

Nothing is imported here: the configuration imports the catalog without torch.
"""
