"""Trackers: where each step's metrics go besides `metrics.jsonl` (TensorBoard, Weights & Biases, MLflow).

The driver holds one `session.Trackers`, which opens the trackers named in `runner.logger.backends`, continues
their runs after a resume (run ids in `<log_dir>/trackers.json`) and sends each step to each tracker exactly
once: a step a tracker's store already holds is not sent again, and steps its store lost (a killed process)
are sent again from `metrics.jsonl`.

A new tracker is one module with a `base.Tracker` subclass and one line in `registry.TRACKERS` (and, if it
needs a package, one in `registry.PACKAGES`).
"""
