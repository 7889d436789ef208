"""The studies: sweeps that answer a question, each in its own folder (config.py: the trials
and `get_study`; report.py: the answer; README.md: the write-up, with its plots; tests and,
where it has one, its benchmark). Commands that name them run from the repository root,
where `studies` imports."""
