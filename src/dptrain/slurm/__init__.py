"""SLURM, in one package: env.py (every SLURM variable dptrain reads, the port rule, node lists), job.py (a run's job:
its run folder, shape, name and log files), script.py (its sbatch script) and sbatch_lines.py (the script's
#SBATCH lines), containers.py (the container its ranks start in), partition.py (the check that a partition can hold
it), queue.py (submitting, the jobs' states, waiting), requeue.py (the requeue after a stop).

The package sits below distributed/ in the import layers: DistEnv reads its variables through env.py. It imports only the
config, the run folder's layout and the errors.
"""
