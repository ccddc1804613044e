"""What an attempt saves and restores: the driver's state (the data position and the step) beside the actor's, into a
checkpoint (committed only once every rank's write is done) or out of one, or out of an in-memory snapshot.

The driver's state is a `DriverState` (`driver_state.py`) and each rank's its `rank_state` (`ActorWorker`): the same
named parts, saved and loaded through `state_dict`/`load_state_dict`, whether into a checkpoint or a snapshot.

`Trainer` (`trainer.py`) is an `AttemptState`: these methods use its `ctx`, `cfg`, `driver_state`, `actor_group`,
`global_step`, `last_saved_step`, `pending_save` and `_raise_if_lock_lost`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlrunner.errors import CheckpointError
from rlrunner.storage import basename

if TYPE_CHECKING:
    from rlrunner.checkpoint.resume import Checkpoint
    from rlrunner.runner.snapshots import Snapshot


class AttemptState:
    def emergency_save(self) -> str:
        """Save the last completed step unless it is saved (committed before returning); what was done, for a
        message."""
        step = self.global_step
        if step == 0:
            return "no step had finished, so there is nothing to save"
        if self.last_saved_step == step:
            return f"global_step_{step} is already saved"
        self.save_checkpoint(step)
        return f"saved {basename(self.commit_pending_save(wait=True))}"

    def driver_state_of(self, step: int) -> dict[str, Any]:
        """The driver's state after `step` (a checkpoint's data/data.pt, a snapshot's driver part)."""
        if self.driver_state.step != step:
            raise RuntimeError(f"saving step {step} with the driver's state of step {self.driver_state.step}")
        return self.driver_state.state_dict()

    def save_checkpoint(self, step: int) -> None:
        """Save `step`: committed before returning, or (`runner.async_save`) written in the background and
        committed by `commit_pending_save` once every rank's write has finished. One save in flight at a time."""
        self.commit_pending_save(wait=True)
        self.pending_save = self.ctx.handler.begin_save(
            step,
            self.ctx.checkpoint_manager(self.actor_group),
            self.driver_state_of(step),
            write_extra=self.ctx.write_hf_files,
            extra_manifest={"epoch": self.loader.epoch, "experiment_name": self.cfg.runner.experiment_name},
        )
        if not self.cfg.runner.async_save:
            self.commit_pending_save(wait=True)

    def commit_pending_save(self, wait: bool) -> str | None:
        """Commit the save in flight once its writes are done (waiting for them with `wait`); its URL, or None.

        Only a committed checkpoint counts: `last_saved_step` moves here, never when a save begins.
        """
        if self.pending_save is None:
            return None
        self._raise_if_lock_lost(f"committing global_step_{self.pending_save.step}")
        path = self.ctx.handler.finish_save(self.pending_save, wait)
        if path is not None:
            self.last_saved_step = self.pending_save.step
            self.pending_save = None
        return path

    def restore(self, checkpoint: Checkpoint) -> None:
        saved = self.ctx.handler.load(checkpoint, self.ctx.checkpoint_manager(self.actor_group))
        try:
            self.driver_state.load_state_dict(saved)
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {checkpoint.url} does not fit this run's data: {exc}") from None
        self.global_step = self.driver_state.step
        self.last_saved_step = self.global_step

    def restore_snapshot(self, snapshot: Snapshot, last_saved_step: int | None) -> None:
        """Load an in-memory snapshot into the actor group (`last_saved_step`: the newest committed checkpoint's). A
        part lost since it was chosen fails the attempt (the ranks may hold half of it): the next attempt finds the
        snapshot incomplete and loads the checkpoint."""
        saved = self.ctx.snapshots.load(snapshot, self.actor_group, self.cfg.runner.recovery.step_timeout_s)
        self.driver_state.load_state_dict(saved)
        self.global_step = self.driver_state.step
        self.last_saved_step = last_saved_step
