"""Sweeps: trials of a config defined beside it (spec), run and tracked (runner), reported
(report); the command is `python -m lambjax.sweep`."""
