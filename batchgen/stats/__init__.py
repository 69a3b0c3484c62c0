"""A run's statistics: the sum of the engine's step reports and the job's row counts
(run_stats.py), and GPU utilisation sampled from NVML (nvml.py)."""
