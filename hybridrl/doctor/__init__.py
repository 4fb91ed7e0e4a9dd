"""``hybridrl doctor``: diagnoses of a job. ``mismatch``: the rollout/trainer log-prob gap
and its causes (``mismatch.py``), reported as a table, JSON and a plot (``report.py``)."""
