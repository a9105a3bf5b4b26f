"""The benchmark harness: Celery's `group` and `chord` against `fan_in_group`, on one broker, pool and machine.

`python -m bench --help`; see BENCHMARKS.md for the figures and how they are measured.
"""
