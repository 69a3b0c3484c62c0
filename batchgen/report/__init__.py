"""`batchgen report OUT`: the run's metrics (_stats.json, _steps.parquet) as one self-contained
HTML page with its plots inline (load.py reads, plots.py draws, page.py writes)."""
