"""Slurm: a Ray cluster inside a Slurm job, and ``raytrain submit --slurm`` to start one.

- ``sbatch``: the job's options, the sbatch script (kept in the run's Slurm folder) and its
  submission;
- ``ports``: each job's own block of ports (two jobs on one node never share one);
- ``job``: what runs inside the allocation: Ray's head on the first node and its workers
  on the rest through ``srun``, ``raytrain run`` against that cluster, Slurm's USR1 notice
  turned into a stop at a committed checkpoint, then ``scontrol requeue``;
- ``control``: ``raytrain status|logs|stop slurm:JOBID`` through ``scontrol`` and ``scancel``.
"""
