"""areal-slurm: Slurm as an areal-kernel scheduler (``scheduler.type: slurm``)."""
