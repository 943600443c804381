"""SLURM, in one package: env.py (every SLURM variable dptrain reads, the port rule, node lists), job.py (the sbatch
script of a run, its submission, check against the partition and requeue), queue.py (the jobs' states, waiting).

The package sits below distributed/ in the import layers: DistEnv reads its variables through env.py. It imports only the
config, the run folder's layout and the errors.
"""
