"""Weights & Biases: one W&B run per experiment, continued by id (`resume="allow"`) after a resume.

Files go under `<log_dir>/wandb/`. The newest step the run holds: online, the server's (`run.starting_step - 1`,
known at init); offline, what the run's transaction logs on disk hold (a killed process loses the records it had
not flushed, so the disk, not this process's memory, is the truth); disabled, none.
"""

from __future__ import annotations

import logging
import secrets
import string
from pathlib import Path
from typing import Any

from rlrunner.trackers.base import Tracker
from rlrunner.trackers.wandb_offline import offline_last_step

logger = logging.getLogger(__name__)


def new_run_id() -> str:
    """A fresh run id in W&B's form (8 lowercase letters and digits)."""
    try:
        from wandb.sdk.lib.runid import generate_id  # wandb 0.31 (wandb.util has no generate_id there)
    except ImportError:  # moved in another version: the same form
        alphabet = string.ascii_lowercase + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(8))
    return generate_id()


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.run: Any = None
        self.run_id: str | None = None
        self._sent = -1  # the newest step this process handed to W&B

    def open(self, continue_state: dict[str, Any] | None) -> dict[str, Any]:
        import wandb

        self.run_id = (continue_state or {}).get("run_id") or new_run_id()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        options: dict[str, Any] = {}
        if self.cfg.get("mode"):
            options["mode"] = self.cfg["mode"]
        self.run = wandb.init(
            project=self.cfg.get("project"),
            entity=self.cfg.get("entity"),
            name=self.run_name,
            id=self.run_id,
            resume="allow",
            dir=str(self.log_dir),
            config=self.config,
            # no console capture and no system-metrics sampling (the driver runs for days); a run object of our own
            # that leaves wandb.run and any other run of the process alone
            settings=wandb.Settings(console="off", x_disable_stats=True, reinit="create_new"),
            **options,
        )
        mode = "disabled" if self.run.disabled else "offline" if self.run.offline else "online"
        logger.info("W&B run %s (%s, %s)", self.run_id, mode, "continued" if continue_state else "new")
        return {"run_id": self.run_id, "project": self.cfg.get("project"), "entity": self.cfg.get("entity")}

    def last_step(self) -> int:
        if self.run.disabled:
            held = -1
        elif self.run.offline:
            held = offline_last_step(Path(self.run.settings.sync_dir).parent, self.run_id)
        else:
            held = self.run.starting_step - 1  # the server's, as of wandb.init
        return max(held, self._sent)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step, commit=True)  # commit: written now, not held until the next step
        self._sent = max(self._sent, step)

    def close(self, status: str) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=1 if status == "failed" else 0)  # a stop on request is a clean exit
