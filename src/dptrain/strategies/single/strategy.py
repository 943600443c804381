"""One process, one device: the base Strategy as it is."""

from dptrain.config import StrategyConfig
from dptrain.strategies.base import Strategy, refuse_more_than_one_process
from dptrain.strategies.single.options import SPEC


class SingleDevice(Strategy):
    spec = SPEC
    one_process = True

    @classmethod
    def check_world(cls, cfg: StrategyConfig, world_size: int, on_cpu: bool, torch_version: str) -> None:
        refuse_more_than_one_process(cls.name, world_size, "it runs one process")
