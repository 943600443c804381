"""One process, one device: the base Strategy as it is."""

from dptrain.config import SPECS, StrategyConfig
from dptrain.strategies.base import Strategy, refuse_more_than_one_process


class SingleDevice(Strategy):
    spec = SPECS["single"]
    one_process = True

    @classmethod
    def check_world(cls, cfg: StrategyConfig, world_size: int, on_cpu: bool, torch_version: str) -> None:
        refuse_more_than_one_process(cls.name, world_size, "it runs one process")
