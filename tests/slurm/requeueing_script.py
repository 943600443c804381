"""A training script of a user's that keeps the requeue contract of `dptrain submit --requeue -- script.py`: on
SIGUSR1 (passed on by torchrun), rank 0 requeues the job where DPTRAIN_REQUEUE is 1, and every rank exits; otherwise
it "trains" (sleeps) for up to 2 minutes."""

import os
import signal
import subprocess
import sys
import time

stop = []
signal.signal(signal.SIGUSR1, lambda signum, frame: stop.append(signum))
deadline = time.monotonic() + 120
while not stop and time.monotonic() < deadline:
    time.sleep(0.1)
if stop and os.environ.get("RANK") == "0" and os.environ.get("DPTRAIN_REQUEUE") == "1":
    print("rank 0: requeueing", flush=True)
    subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)
sys.exit(0)
