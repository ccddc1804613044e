"""Helpers shared by the scripts in `benchmarks/` (each script stays runnable as `python benchmarks/bench_X.py`).

    common        timing, a private local Ray, work folders, JSON-lines logs, what the machine is
    model         model shapes of a chosen size, and the run config of a benchmark's actor group
    groups        worker groups built the way the trainer builds them (`rlrunner.runner.placement.group_specs`),
                  one real update so the optimizer state exists, the backend's checkpoint manager
    ckpt_*        bench_checkpoint.py's measurements and reports
    recovery_*    bench_recovery.py's runs with workers killed, and its reports

Some functions here run inside Ray workers (`worker.__ray_call__`). The workers cannot import this package (the
scripts put `benchmarks/` on their own path only), so its functions and classes are shipped by value.
"""

from __future__ import annotations

import sys

from ray import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # covers every submodule (benchlib.*)
