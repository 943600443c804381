"""Evaluation on the test split, sharded over the ranks with exact counts, and the predictions file.

Each rank runs its share of every test batch (no gradients, no gradient sync); the sums of loss,
correct and samples are reduced once at the end, so every test sample counts exactly once.
"""

from __future__ import annotations

import contextlib
import csv
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.data.loader import Loader
from dptrain.events import EVAL_ACC, EVAL_COUNT, EVAL_LOSS, EVAL_TIME_S
from dptrain.files import written_atomically
from dptrain.metrics import finite_or_none


def evaluate(
    module: nn.Module,
    loader: Loader,
    autocast: Callable[[], contextlib.AbstractContextManager],
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
    predictions: list[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Loss and accuracy over the whole split; with `predictions`, appends (index, label, predicted) rows of this rank."""
    was_training = module.training
    module.eval()
    device = next(module.parameters()).device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, samples (this rank)
    samples = 0  # counted on the host: a count made a tensor on the device each batch was a host-to-device copy
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        # Every rank runs every batch, empty shares included: a sharded model (fsdp) gathers its
        # parameters inside forward, which needs all ranks.
        for batch in loader.epoch_batches(0):
            with autocast():
                logits = module(batch.images)
            predicted = logits.argmax(1)
            loss = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), batch.labels, reduction="sum")
            sums[:2] += torch.stack([loss.double(), (predicted == batch.labels).sum().double()])
            samples += len(batch.labels)
            if predictions is not None:
                predictions.append(torch.stack([batch.indices, batch.labels, predicted], 1).cpu())
    sums[2].fill_(samples)  # the number goes to the GPU as the fill kernel's argument: no copy, once
    all_reduce(sums)
    elapsed = time.perf_counter() - start
    module.train(was_training)
    loss, correct, count = sums.tolist()
    return {EVAL_LOSS: finite_or_none(loss / count), EVAL_ACC: correct / count, EVAL_COUNT: int(count),
            EVAL_TIME_S: elapsed}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PREDICTIONS_HEADER = ("index", "label", "predicted")


def write_test_predictions(rows: torch.Tensor, path: Path) -> None:
    """index,label,predicted per test sample, in the split's order; written atomically, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with written_atomically(path) as tmp, tmp.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(PREDICTIONS_HEADER)
        writer.writerows(rows.tolist())
