"""Snapshots through torch.distributed.checkpoint, written atomically, found, verified and loaded safely.

One job a module: `layout` (what a snapshot holds, what its manifest records, verify), `finding` (which snapshot:
listing, the newest verified, the one a resume takes), `saving` (Snapshotter: write, prune, load; when one is due)
and `export` (a snapshot's model outside a run); what the rest of dptrain uses is importable from here.


A snapshot is a folder checkpoints/step-00000120/ holding the DCP shards of the model and the
optimizer (or, for zero1 and ps, whose optimizers DCP cannot see into, the whole optimizer state
in optimizer.pt, written by rank 0; for deepspeed, the model in DCP and DeepSpeed's own checkpoint,
as plain data, in deepspeed/), one rank<R>.pt per rank (its RNG states and its partial-epoch
sums), extra.pt (the loop's TrainState and the scheduler) and manifest.json (world size, strategy,
model, the options that change the computation, torch version, every file with its size and
sha256). It is written under .tmp-step-..., flushed, then renamed, and only then does
checkpoints/latest (a one-line file, replaced atomically) point at it: a crash at any moment
leaves the previous snapshot whole and found. Every file is read back through safe_load's
allow-lists: a snapshot holds data, never code.
"""

from dptrain.snapshots.export import SAFETENSORS, export_weights, snapshot_model
from dptrain.snapshots.finding import (AFRESH, choose, find_latest, find_snapshot, list_snapshots, newest_verified,
                                       not_a_snapshot_folder, rerun_ending, snapshot_folders)
from dptrain.snapshots.layout import (EXTRA, LATEST, MANIFEST, PREFIX, check_compatible, computation_options, config_hash,
                                      recorded_hash, recorded_options, verify)
from dptrain.snapshots.saving import Snapshotter, check_one_folder, write_failure

__all__ = ["AFRESH", "EXTRA", "SAFETENSORS", "LATEST", "MANIFEST", "PREFIX", "Snapshotter", "check_compatible", "check_one_folder",
           "choose", "computation_options", "config_hash", "export_weights", "find_latest", "find_snapshot",
           "list_snapshots", "newest_verified", "not_a_snapshot_folder", "recorded_hash", "recorded_options",
           "rerun_ending", "snapshot_folders", "snapshot_model", "verify", "write_failure"]
