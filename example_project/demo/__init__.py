"""The README's demo: three beats whose clocks disagree, one worker, every slot exactly once.

``bash example_project/demo/demo.sh`` builds a virtual environment and runs ``python -m demo``
from ``example_project/`` (:mod:`demo.__main__`); :mod:`demo.report` counts and draws. The
processes (a Redis of its own, the beats with skewed clocks, the worker) are started with
:mod:`celery_driftsafe.testing.processes`, as the end-to-end tests and the benchmarks do.
"""
