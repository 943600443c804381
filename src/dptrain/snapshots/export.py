"""A snapshot's model outside a run: built with the snapshot's weights, whole whatever the sharding (eval, predict),
or written as one plain state_dict file (`dptrain checkpoint export`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dptrain.config import RunConfig

SAFETENSORS = ".safetensors"  # an export file with this suffix is written as safetensors
from dptrain.data import input_record
from dptrain.errors import ConfigError, SnapshotError
from dptrain.files import written_atomically
from dptrain.safe_load import dcp_load
from dptrain.snapshots.layout import reading, verify


def snapshot_model(cfg: RunConfig, snapshot: Path, image_shape: tuple[int, ...], num_classes: int | None,
                   device: torch.device) -> tuple[torch.nn.Module, dict[str, Any]]:
    """(the run's model with the snapshot's weights, whole whatever the sharding; the snapshot's manifest)."""
    from dptrain.models import build_model

    manifest = verify(snapshot)
    if manifest["model"] != cfg.model.name:
        raise SnapshotError(f"snapshot {snapshot} holds model {manifest['model']}, not {cfg.model.name}.")
    model = build_model(cfg.model, image_shape, num_classes).to(device)
    if cfg.train.channels_last and device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    state = {"model": model.state_dict()}
    with reading(manifest, snapshot, "model's weights (DCP shards)"):
        dcp_load(state, snapshot)  # only the model's entries; fsdp shards come back whole
        model.load_state_dict(state["model"])
    return model, manifest


def export_weights(cfg: RunConfig, snapshot: Path, manifest: dict[str, Any], output: Path) -> int:
    """The snapshot's model weights, whole, as one plain state_dict file at output that `torch.load(weights_only=True)`
    reads and `model.load_state_dict` takes (what the tutorials save), or, where output ends in .safetensors, as
    safetensors (read without torch's unpickler: safetensors.torch.load_file); the number of tensors written. Never
    replaces a file: ConfigError where output exists."""
    import warnings

    from dptrain.data import describe

    if output.exists() or output.is_symlink():
        raise ConfigError(f"{output} exists; give a new file name for the weights, or delete it first.")
    if not output.parent.is_dir():
        raise ConfigError(f"{output.parent} is not a folder; give a file name in an existing folder.")
    record = manifest.get("input") or input_record(cfg.data)
    if record is not None:
        shape, classes = tuple(record["shape"]), int(record["num_classes"])
    else:  # a Dataset of the user's: its first sample says the shape
        info = describe(cfg.data)
        shape, classes = info.image_shape, info.num_classes
    with warnings.catch_warnings():  # DCP's "no process group: loading in a single process" is what happens here
        warnings.simplefilter("ignore", UserWarning)
        model, _ = snapshot_model(cfg, snapshot, shape, classes, torch.device("cpu"))
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    with written_atomically(output) as tmp:
        if output.suffix == SAFETENSORS:
            from safetensors.torch import save_file

            # one storage per tensor: safetensors refuses tensors that share memory
            save_file({name: tensor.clone() for name, tensor in state.items()}, str(tmp),
                      metadata={"model": cfg.model.name, "snapshot": snapshot.name, "torch": str(manifest.get("torch"))})
        else:
            torch.save(state, tmp)
    return len(state)
