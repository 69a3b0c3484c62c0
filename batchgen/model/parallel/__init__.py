"""Tensor parallelism inside one model: which slice of each weight a rank holds (sharding), and the
collectives added to a built rank's decoder. (The ranks' processes are batchgen/parallel/.)"""
