"""Running one job: the request stream into the engine, finished rows out to the writer,
signals, progress and statistics (run.py)."""
