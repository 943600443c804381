"""output.trackers mlflow: the run in MLflow, through its client. Where output.mlflow_uri gives no tracking URI, the
store is an SQLite database in the run folder (mlflow/mlflow.db, the artifacts beside it in mlflow/artifacts/): no
server, and `mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow/mlflow.db` shows it. (MLflow 3 keeps its file
store, ./mlruns, in maintenance and refuses it unless MLFLOW_ALLOW_FILE_STORE is set: SQLite is its own default now.)

The MLflow run's id is kept in mlflow/run_id, so a resumed run goes on with the same MLflow run; its steps after the
snapshot are then logged a second time, the later value the resumed run's (MLflow keeps every value it is given).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from dptrain.config import RunConfig
from dptrain.files import written_atomically

MAX_PARAMS_A_CALL = 100  # MLflow's limit of parameters in one log_batch
STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


class MlflowTracker:
    def __init__(self, cfg: RunConfig) -> None:
        self.folder = cfg.output.folder.mlflow
        self.uri = cfg.output.mlflow_uri
        self.run_name = cfg.output.run_dir.name
        self.run_dir = str(cfg.output.run_dir.resolve())
        self.client: Any = None
        self.run_id: str | None = None

    def start(self, params: dict[str, bool | int | float | str]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.folder.mkdir(parents=True, exist_ok=True)
        uri = self.uri or f"sqlite:///{(self.folder / 'mlflow.db').resolve()}"
        self.client = client = MlflowClient(tracking_uri=uri)
        id_file = self.folder / "run_id"
        if id_file.is_file():  # a resume: the same MLflow run goes on (its parameters are logged already)
            self.run_id = id_file.read_text().strip()
            client.update_run(self.run_id, status="RUNNING")
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "dptrain")
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # in the run folder's own store, its artifacts beside the database
            artifacts = None if self.uri else (self.folder / "artifacts").resolve().as_uri()
            experiment_id = client.create_experiment(name, artifact_location=artifacts)
        run = client.create_run(experiment_id, run_name=self.run_name, tags={"dptrain.run_dir": self.run_dir})
        self.run_id = run.info.run_id
        with written_atomically(id_file) as tmp:
            tmp.write_text(self.run_id + "\n")
        items = [Param(key, str(value)) for key, value in params.items()]
        for start in range(0, len(items), MAX_PARAMS_A_CALL):
            client.log_batch(self.run_id, params=items[start:start + MAX_PARAMS_A_CALL])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step) for key, value in metrics.items()])

    def artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, status: str) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, status=STATUS[status])
