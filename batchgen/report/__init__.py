"""`batchgen report OUT`: the run's metrics (.batchgen/stats.json, the step timeline) as one
self-contained HTML page with its plots inline (load.py reads, plots.py draws, page.py writes)."""
