"""Engine statistics (stats.py) and what records them: Prometheus (prometheus.py) and the periodic
log line (loggers.py)."""
