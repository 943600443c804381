"""dptrain: data-parallel training of image classifiers with PyTorch's own distributed engine."""

__version__ = "0.1.0"
