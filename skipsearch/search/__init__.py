"""The Optuna study: the search space, paired measurement, scoring a skip set, typed records and their one conversion
to Optuna's attributes, the one ranking ("best"), storages and heartbeats, warm starts, a worker's trials, and the
study itself (study.py)."""
