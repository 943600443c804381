"""DeepSpeed's own checkpoint written and read as plain data (PlainDataCheckpointEngine): every object DeepSpeed would
pickle becomes tensors, numbers, strings and marked dicts, so that a snapshot loads with weights_only=True and runs
no code."""

from __future__ import annotations

from typing import Any

import torch

def _plain_forms() -> dict[str, type]:
    """The few DeepSpeed objects its checkpoints hold (fp32 ZeRO 1 to 3), by the name their plain form records."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return {f"{cls.__module__}.{cls.__qualname__}": cls for cls in (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)}


PLAIN_MARK = "__deepspeed_object__"
PLAIN_TYPES = (torch.Tensor, torch.Size, torch.dtype, int, float, complex, bool, str, bytes, type(None), set, frozenset)
"""What torch.load(weights_only=True) reads back, besides dicts, lists and tuples."""


def to_plain(value: Any, forms: dict[str, type]) -> Any:
    """value with each DeepSpeed object replaced by {PLAIN_MARK: its class's name, "state": its plain attributes}."""
    if isinstance(value, dict):
        return type(value)((key, to_plain(item, forms)) for key, item in value.items())  # dict or OrderedDict
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(to_plain(item, forms) for item in value)
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    if name in forms:
        state = int(value) if isinstance(value, int) else to_plain(dict(vars(value)), forms)
        return {PLAIN_MARK: name, "state": state}
    if not isinstance(value, PLAIN_TYPES):  # refused now, not by the resume that would read it
        raise TypeError(f"DeepSpeed's checkpoint holds a {name}, which dptrain cannot write as plain data (it knows "
                        f"{', '.join(forms)}); this DeepSpeed version or setting is not supported by strategy deepspeed.")
    return value


def from_plain(value: Any, forms: dict[str, type]) -> Any:
    """to_plain undone, for the classes of `forms` only; nothing in the file chooses what code runs."""
    if isinstance(value, dict):
        if PLAIN_MARK in value:
            if value[PLAIN_MARK] not in forms:
                raise ValueError(f"the snapshot's DeepSpeed checkpoint holds a {value[PLAIN_MARK]}, which this DeepSpeed "
                                 f"does not have; resume with the DeepSpeed version that wrote it.")
            cls = forms[value[PLAIN_MARK]]
            if issubclass(cls, int):
                return cls(value["state"])
            obj = cls.__new__(cls)
            obj.__dict__.update(from_plain(value["state"], forms))
            return obj
        return type(value)((key, from_plain(item, forms)) for key, item in value.items())
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(from_plain(item, forms) for item in value)
    return value


def plain_data_checkpoint_engine() -> Any:
    """DeepSpeed's torch checkpoint engine, saving plain data and loading it with weights_only=True."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class PlainDataCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's own loader would torch.load(weights_only=False) a file that a snapshot holds, which could run
        code; here each file is written as plain data (to_plain) and read back with weights_only=True."""

        forms = _plain_forms()

        def save(self, state_dict: Any, path: str) -> None:
            torch.save(to_plain(state_dict, self.forms), path)

        def load(self, path: str, map_location: Any = None) -> Any:
            return from_plain(torch.load(path, map_location=map_location, weights_only=True), self.forms)

    return PlainDataCheckpointEngine()
