"""The built-in datasets, models and experiment trackers by name, each with where it is implemented
(`package.module:attr`, imported only by dptrain.data, dptrain.models and dptrain.metrics.trackers, which build their
tables from these): the one list of data.name's, model.name's and output.trackers' built-in choices. Torch-free, so
that config checks a name before torch is imported. docs/extending.md says how to add one."""

from __future__ import annotations

from dataclasses import dataclass

DATASETS: dict[str, str] = {
    "fashion-mnist": "dptrain.data.catalog:FASHION_MNIST",
    "mnist": "dptrain.data.catalog:MNIST",
    "cifar10": "dptrain.data.catalog:CIFAR10",
}
"""The datasets read from files: name -> its DatasetSpec (its shape, statistics, files and reader)."""
SYNTHETIC = "synthetic"
"""The dataset generated from data.synthetic_* (dptrain.data.synthetic), not read from files."""
DATASET_NAMES = (*DATASETS, SYNTHETIC)
"""data.name's built-in choices."""


@dataclass(frozen=True)
class ModelChoice:
    """A built-in model: its class, built as Class(num_classes=...), and with in_channels=... where it takes any
    number of channels; the images it takes."""

    builds: str
    """Its nn.Module class, as `package.module:Class`."""
    channels: int | None
    """The channels of the images it takes; None: any (then it is built with in_channels)."""
    size: tuple[int, int] | None
    """The height and width of the images it takes; None: any."""


MODELS: dict[str, ModelChoice] = {
    "mnist-cnn": ModelChoice("dptrain.models.mnist_cnn:MnistCNN", channels=1, size=(28, 28)),
    "cifar-cnn": ModelChoice("dptrain.models.cifar_cnn:CifarCNN", channels=None, size=(32, 32)),
    "resnet18": ModelChoice("dptrain.models.resnet:ResNet18", channels=None, size=None),
}
"""model.name's built-in choices."""
MODEL_NAMES = tuple(MODELS)


@dataclass(frozen=True)
class TrackerChoice:
    """An experiment tracker that rank 0 sends the run's events to (output.trackers): its class and what it needs."""

    builds: str
    """Its Tracker class (dptrain.metrics.trackers' protocol), as `package.module:Class`."""
    needs: tuple[str, ...]
    """The modules it imports, looked for before any worker starts."""
    install: str
    """What installs them."""


TRACKERS: dict[str, TrackerChoice] = {
    "mlflow": TrackerChoice("dptrain.metrics.trackers.mlflow_tracker:MlflowTracker",
                            ("mlflow", "sqlalchemy", "alembic"), "pip install 'dptrain[mlflow]'"),
    "wandb": TrackerChoice("dptrain.metrics.trackers.wandb_tracker:WandbTracker", ("wandb",),
                           "pip install 'dptrain[wandb]'"),
}
"""output.trackers' choices."""
