"""The run folder's layout: every file and folder a run writes, named once.

    runs/<name>/
      config.toml     the resolved configuration (eval and predict rebuild the model from it)
      env.json        versions, host, device, git revision
      metrics.jsonl   one event a line: run_start, step, epoch, eval, run_end
      logs/           rank<R>.log for every rank, launcher.log (the elastic agent), slurm-<job>.out/.err,
                      gpu_rank<R>.log (NVML samples on a GPU rank)
      checkpoints/    step-<N>/ snapshots and `latest`
      model.pt        the final weights, whole, for plain torch.load (output.weights_dir/weights_file put them
                      elsewhere: the tutorials' --model_dir/--model_filename)
      tb/             TensorBoard's event files; profile/: each rank's torch.profiler trace (train.profile)
      mlflow/         output.trackers mlflow's store where no output.mlflow_uri is given (mlflow.db, artifacts/),
                      and the MLflow run's id (run_id), which a resume goes on with
      wandb/          output.trackers wandb's run folders (offline-run-*), and the W&B run's id (dptrain-run-id)
      job.sbatch      the job script `dptrain submit` wrote (a submitted run only)
      job.toml        the configuration as given to `dptrain submit`, which the job trains from
      card/           the run's card, card.md and its plots (`dptrain card`; report/ before)
      doctor.json     what `dptrain doctor` checked and found, node 0's table as data
      doctor-job/     the job `dptrain doctor --slurm` submits: its script, config and output
      rehearsal/      the twins `dptrain submit --rehearse` submits, a run folder each (preempted, sigterm, uninterrupted)
      rehearsal.md    the rehearsal's table; rehearsal.json, the same as data
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# In checkpoints/: a snapshot's folder is SNAPSHOT_PREFIX + its step (step-00000120), its manifest SNAPSHOT_MANIFEST,
# and SNAPSHOT_LATEST names the newest (the snapshots package writes them; the run card reads them without torch).
SNAPSHOT_PREFIX, SNAPSHOT_MANIFEST, SNAPSHOT_LATEST = "step-", "manifest.json", "latest"


@dataclass(frozen=True)
class RunFolder:
    root: Path
    weights: Path | None = None
    """The final weights' file where the run was told to save them elsewhere (OutputConfig.weights); None: model.pt."""

    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    @property
    def env(self) -> Path:
        return self.root / "env.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def model(self) -> Path:
        return self.weights if self.weights is not None else self.root / "model.pt"

    @property
    def tb(self) -> Path:
        return self.root / "tb"

    @property
    def profile(self) -> Path:
        """train.profile's traces, rank<R>.<time>.pt.trace.json, where TensorBoard's profiler plugin finds them."""
        return self.tb / "profile"

    @property
    def mlflow(self) -> Path:
        return self.root / "mlflow"

    @property
    def wandb(self) -> Path:
        return self.root / "wandb"

    @property
    def job_script(self) -> Path:
        return self.root / "job.sbatch"

    @property
    def job_config(self) -> Path:
        return self.root / "job.toml"

    @property
    def card(self) -> Path:
        """The run card's folder: a resume never writes there, so a card survives the run going on."""
        return self.root / "card"

    @property
    def earlier_card(self) -> Path:
        """Where a dptrain of before `card/` wrote the card (report/report.md): still a folder of the run's own."""
        return self.root / "report"

    @property
    def doctor(self) -> Path:
        return self.root / "doctor.json"

    @property
    def doctor_job(self) -> Path:
        return self.root / "doctor-job"

    @property
    def rehearsal(self) -> Path:
        return self.root / "rehearsal"

    @property
    def rehearsal_table(self) -> Path:
        return self.root / "rehearsal.md"

    @property
    def rehearsal_record(self) -> Path:
        return self.root / "rehearsal.json"

    @property
    def launcher_log(self) -> Path:
        return self.logs / "launcher.log"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def gpu_log(self, rank: int) -> Path:
        return self.logs / f"gpu_rank{rank}.log"

    def job_output(self, job_id: str, stream: str) -> Path:
        """SLURM's file for the job's stdout (stream "out") or stderr ("err")."""
        return self.logs / f"slurm-{job_id}.{stream}"

    def written_by_a_run(self) -> tuple[tuple[Path, bool], ...]:
        """(path, whether it is a folder) of what a run writes into or appends to, rather than replaces whole."""
        return ((self.checkpoints, True), (self.logs, True), (self.tb, True), (self.mlflow, True), (self.wandb, True),
                (self.metrics, False))

    def own_names(self) -> dict[Path, tuple[str, bool]]:
        """Every file and folder of the run named here but the final weights -> (what the run keeps there, whether it
        is a folder)."""
        return {self.config: ("configuration", False), self.env: ("environment record", False),
                self.metrics: ("metrics", False), self.logs: ("logs", True), self.checkpoints: ("snapshots", True),
                self.tb: ("TensorBoard files", True), self.mlflow: ("MLflow store", True),
                self.wandb: ("W&B runs", True), self.job_script: ("job script", False),
                self.job_config: ("job's configuration", False), self.card: ("card", True),
                self.earlier_card: ("card", True),
                self.doctor: ("doctor's report", False), self.doctor_job: ("doctor's job", True),
                self.rehearsal: ("rehearsal's twins", True), self.rehearsal_table: ("rehearsal's table", False),
                self.rehearsal_record: ("rehearsal's record", False)}

    def holds_a_run(self) -> bool:
        """Whether the folder holds something a run (or submit, or the doctor) makes there: one of its own names, or
        model.pt; a folder of other files (/etc, a project's folder) is no run's to adopt."""
        return any(p.exists() or p.is_symlink() for p in (*self.own_names(), RunFolder(self.root).model))

    def keeps(self, path: Path) -> tuple[Path, str] | None:
        """(the run folder's own file or folder, what the run keeps there) where path is it, lies inside it, or is the
        run folder itself ((root, "directory")); None where path is none of the run's own (the final weights'
        file, a file of the user's). Paths compare resolved: runs/run/../run/config.toml is config.toml."""
        target = path.resolve()
        if target == self.root.resolve():
            return self.root, "directory"
        for own, (what, folder) in self.own_names().items():
            mine = own.resolve()
            if target == mine or (folder and mine in target.parents):
                return own, what
        return None

