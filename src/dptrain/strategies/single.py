"""One process, one device: the base Strategy as it is."""

from dptrain.strategies.base import Strategy


class SingleDevice(Strategy):
    name = "single"
