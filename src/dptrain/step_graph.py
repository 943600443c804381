"""A whole training step captured once as a CUDA graph and replayed (train.cuda_graph).

A step of a small model is mostly kernel launches: the tutorials' CNN launches about 64 kernels
per step, which costs an H100's host about 2.4 ms for 0.8 ms of GPU work. Replaying a graph
launches them all at once. What this needs, and what it costs:
  - the step runs no collective (one device: strategies single, ddp at world size 1, dp on one GPU);
  - no host sync inside the step (a user model with `.item()` in forward cannot be captured:
    the capture fails, says so in one line, and the run goes on eagerly);
  - static tensors: each full batch is copied into the graph's input buffers, the loss and the
    count of correct predictions come out in its output buffers. The last, smaller batch of an
    epoch runs eagerly with the same model and optimizer;
  - Adam or AdamW, fused and capturable, captured with its learning rate in a device tensor that
    is refilled from the schedule after each step (a graph bakes in plain numbers: a Python float
    lr would never change). Outside the capture the optimizer keeps plain floats, so that
    schedules and snapshots see what they always see.
The first WARMUP steps run eagerly on a side stream, so that cuDNN and cuBLAS choose their kernels
and workspaces before the capture; the capture itself records the step without running it, so
the batch that is captured is then replayed. Dropout's random numbers come from the same
generator, advanced by each replay.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger("dptrain")

Step = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(images, labels) -> (sum of the loss over the batch, number of correct predictions), training the model once."""


class StepGraph:
    WARMUP = 3

    def __init__(self, step: Step, optimizer: torch.optim.Optimizer, batch_size: int) -> None:
        self.step, self.optimizer, self.batch_size = step, optimizer, batch_size
        self.eager_steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed = False
        self.inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        # The learning rates the captured optimizer reads at every replay.
        self.lrs = [torch.tensor(float(group["lr"]), dtype=torch.float32, device=_device(group)) for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["capturable"] = True  # also after resuming from a snapshot written without a graph

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(labels) != self.batch_size or self.failed:
            return self.step(images, labels)
        if self.graph is None and self.eager_steps < self.WARMUP:
            self.eager_steps += 1
            return self._on_side_stream(images, labels)
        if self.graph is None:
            self._capture(images, labels)
            if self.failed:
                return self.step(images, labels)
        assert self.graph is not None and self.inputs is not None and self.outputs is not None
        self.inputs[0].copy_(images)
        self.inputs[1].copy_(labels)
        self.graph.replay()
        return self.outputs[0].clone(), self.outputs[1].clone()  # the next replay overwrites the buffers

    def after_schedule_step(self) -> None:
        """Put the schedule's new learning rates where the graph reads them (a fill, no host sync)."""
        if self.graph is not None:
            for group, lr in zip(self.optimizer.param_groups, self.lrs):
                lr.fill_(group["lr"])

    def _on_side_stream(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self.step(images, labels)
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _capture(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.inputs = (images.clone(), labels.clone())
        graph = torch.cuda.CUDAGraph()
        floats = [group["lr"] for group in self.optimizer.param_groups]
        try:
            for group, lr in zip(self.optimizer.param_groups, self.lrs):
                lr.fill_(group["lr"])
                group["lr"] = lr  # captured by address
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                self.outputs = self.step(*self.inputs)
        except Exception as exc:  # noqa: BLE001 - any capture failure: say so once and train eagerly
            self.failed = True
            self.inputs = self.outputs = None
            log.warning("train.cuda_graph: the training step could not be captured (%s); training eagerly",
                        str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
            return
        finally:
            for group, value in zip(self.optimizer.param_groups, floats):
                group["lr"] = value
        self.graph = graph
        log.info("train.cuda_graph: training step captured after %d eager steps", self.eager_steps)


def _device(group: dict) -> torch.device:
    return group["params"][0].device
