"""Tensor parallelism across processes: one job's model split over N ranks (one per GPU, or
N processes on the CPU over gloo for tests and debugging).

Rank 0 is the process that runs the job: reader, scheduler, block pool, grammars, sampling,
writer and stats. It starts the other ranks itself (ranks.py), sends each of them every
command its runner gets (the step's model inputs, the pool's allocation) over a pipe, and
runs its own part; the others only follow (follower.py). Each rank builds its part of the
model from the same spec (rank_model.py); the model's collectives (model/parallel/collectives.py)
run over the process group (group.py)."""
