"""output.trackers wandb: the run in Weights & Biases. Offline by default (output.wandb_mode): the run is written into
the run folder's wandb/offline-run-<time>-<id>/ only, with no network and no login; `wandb sync
RUN_DIR/wandb/offline-run-*` uploads it later. Online sends it as it goes (after `wandb login`).

The W&B run's id is kept in wandb/dptrain-run-id, so a resumed run goes on with the same W&B run (offline, a new
folder of the same id, which `wandb sync` adds to it). The final weights are an artifact of type model.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Any

from dptrain.config import RunConfig
from dptrain.files import written_atomically

EXIT_CODES = {"finished": 0, "stopped": 0, "failed": 1}  # a stopped run is resumed later: not a failure


class WandbTracker:
    def __init__(self, cfg: RunConfig) -> None:
        self.folder = cfg.output.folder.wandb
        self.mode = cfg.output.wandb_mode
        self.run_name = cfg.output.run_dir.name
        self.run: Any = None

    def start(self, params: dict[str, bool | int | float | str]) -> None:
        import wandb

        self.folder.mkdir(parents=True, exist_ok=True)
        id_file = self.folder / "dptrain-run-id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(6)  # W&B's ids: [a-z0-9]
        # dir: wandb makes its own wandb/ inside the folder given; console off: dptrain's log lines are the run's own.
        self.run = wandb.init(dir=str(self.folder.parent), mode=self.mode,
                              project=os.environ.get("WANDB_PROJECT", "dptrain"), name=self.run_name, id=run_id,
                              resume="allow", config=params,
                              settings=wandb.Settings(console="off", silent=True))
        if not id_file.is_file():
            with written_atomically(id_file) as tmp:
                tmp.write_text(run_id + "\n")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def artifact(self, path: Path) -> None:
        import wandb

        name = re.sub(r"[^A-Za-z0-9._-]", "-", self.run_name)  # W&B's artifact names take these only
        artifact = wandb.Artifact(f"{name}-weights", type="model")
        artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def finish(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=EXIT_CODES[status])
