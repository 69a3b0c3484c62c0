"""Scale-out: shard one job over processes, GPUs (workers) or a Slurm array, and merge the parts."""
