"""The uninterrupted reference runs that the integration tests compare against: one per training backend, trained once
per pytest session and kept as files.

A run is bit-for-bit reproducible whatever its failures, resumes, worker processes or cluster: any run of the same
numbers (the model, the data, the algorithm, the seeds) logs the same metrics and holds the same weights after each
step as the reference, whatever its worker counts, CPUs per worker, timeouts, Ray cluster, save schedule or
`runner.max_steps` (the LR schedule is constant). So one reference per backend serves every module and both xdist
workers: the first test that asks for it trains it (inside the Ray that is up then, or a local one of its own, shut
down afterwards; a test of the other worker asking meanwhile waits for it), and later tests only read its files (its
metrics.jsonl, its checkpoints, and the policy's weights and the actor ranks' RNG states after every step), whatever
Ray came and went in between.

The data has 26 problems in batches of 4: 6 steps per epoch, so step 3 is mid-epoch and step 6 the end of epoch 0 (its
2 leftover prompts are dropped). The reference trains 10 steps and saves at 3, 6, 9 and 10.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from conftest import Inspect, assert_bit_equal, read_metrics, run_config, without_time

REFERENCE_STEPS = 10
# what the numbers depend on beside run_config's model and batch: the data and the responses' length
NUMERICS = ["data.synthetic.num_problems=26", "rollout.max_new_tokens=2"]
REFERENCE_RUN = [*NUMERICS, f"runner.max_steps={REFERENCE_STEPS}", "runner.save_interval=3"]
# two query groups, so that tp=2 splits them (with actor.num_workers=2, the default: tp 2 x dp 1)
MEGATRON = [
    "model.override_config.num_key_value_heads=2",
    "actor.training_backend=megatron",
    "actor.tensor_model_parallel_size=2",
]
# an overlapped run (generation one step ahead of the update, test_overlap.py)
LAG1 = ["algorithm.policy_lag=1", "algorithm.rollout_correction.tis_cap=2.0"]
BACKEND_OVERRIDES = {"fsdp": [], "megatron": MEGATRON, "fsdp_lag1": LAG1, "megatron_lag1": [*MEGATRON, *LAG1]}


@dataclass
class Reference:
    output_dir: Path
    metrics: list[dict]

    @property
    def experiment(self) -> Path:
        return self.output_dir / "test"

    def checkpoint(self, step: int) -> Path:
        return self.experiment / "checkpoints" / f"global_step_{step}"

    def weights(self, step: int = REFERENCE_STEPS) -> dict[str, torch.Tensor]:
        """The live policy's full weights (HF key names) after `step` (0: the initial policy)."""
        return self._recorded(step)["weights"]

    def rng(self, step: int = REFERENCE_STEPS) -> list[torch.Tensor]:
        """Each actor rank's torch RNG state after `step`."""
        return self._recorded(step)["rng"]

    def _recorded(self, step: int) -> dict:
        return torch.load(self.output_dir / "steps" / f"{step}.pt", weights_only=True)


def actor_rng_states(trainer) -> list[torch.Tensor]:
    return ray.get([w.__ray_call__.remote(lambda self: torch.get_rng_state()) for w in trainer.actor_group.workers])


def assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """assert_bit_equal in whatever order each lists its keys: for an HF model's state_dict (each layer's weights and
    biases in the model's order) against the Megatron backend's weights (converted from its layout: weights first)."""
    assert_bit_equal(dict(sorted(got.items())), dict(sorted(expected.items())))


def assert_resumed_bitwise(experiment: Path, reference: Reference, resume_step: int, last_step: int) -> None:
    """The run of `experiment` resumed from `resume_step` logged the reference's steps up to `last_step` and saved the
    reference's weights at `last_step`, bit for bit."""
    from rlrunner.tools.convert import load_model_weights

    resumed = read_metrics(experiment / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(resume_step + 1, last_step + 1))
    assert without_time(resumed) == without_time(reference.metrics[resume_step:last_step])
    assert_bit_equal(
        load_model_weights(experiment / "checkpoints" / f"global_step_{last_step}"), reference.weights(last_step)
    )


def train_reference(output_dir: Path, cfg) -> Reference:
    """An uninterrupted run of `cfg` (experiment `test` under `output_dir`), recording the policy's weights and the
    actor ranks' RNG states before the first step (step 0) and after every step."""
    recorded = output_dir / "steps"
    recorded.mkdir()

    def record(trainer, step: int) -> None:
        torch.save({"weights": trainer.policy_weights(), "rng": actor_rng_states(trainer)}, recorded / f"{step}.pt")

    def start(trainer) -> None:
        # a different RNG state on each rank, so that a restore of "rank 0's copy everywhere" would show
        ray.get(
            [
                w.__ray_call__.remote(lambda self: torch.manual_seed(1000 + self.rank))
                for w in trainer.actor_group.workers
            ]
        )
        record(trainer, 0)  # the initial policy
        train_step = trainer.train_step

        def train_and_record(step: int):
            metrics = train_step(step)
            record(trainer, step)
            return metrics

        trainer.train_step = train_and_record

    from rlrunner.runner.supervisor import Supervisor

    Supervisor(cfg, callbacks=[Inspect(on_start=start)]).run()
    return Reference(output_dir, read_metrics(output_dir / "test" / "metrics.jsonl"))


def start_weights(cfg, step: int | None = None) -> dict[str, torch.Tensor]:
    """The policy's weights once a run of `cfg` has started (restored, if it resumes from step `step`); the run then
    trains to its `runner.max_steps`."""
    from rlrunner.runner.supervisor import Supervisor

    seen = {}

    def start(trainer) -> None:
        seen["weights"], seen["step"] = trainer.policy_weights(), trainer.global_step

    Supervisor(cfg, callbacks=[Inspect(start)]).run()
    if step is not None:
        assert seen["step"] == step
    return seen["weights"]


def reference_config(output_dir: Path, backend: str):
    return run_config(output_dir, *REFERENCE_RUN, *BACKEND_OVERRIDES[backend])


_references: dict[str, Reference | BaseException] = {}


def reference_run(backend: str, tmp_path_factory) -> Reference:
    """The session's reference run of `backend` ("fsdp" or "megatron"; "..._lag1" with LAG1): trained at the first
    call of the session's processes (pytest-xdist's workers share it), inside the Ray that is up (else a local one,
    shut down afterwards), then the same files for every later call."""
    if backend not in _references:
        try:
            _references[backend] = _trained_once(backend, _session_folder(tmp_path_factory) / "references")
        except Exception as exc:
            _references[backend] = exc  # not trained again by every later test
            raise
    found = _references[backend]
    if isinstance(found, BaseException):
        raise RuntimeError(f"the {backend} reference run failed earlier in this session: {found!r}") from found
    return found


def _session_folder(tmp_path_factory) -> Path:
    """A folder every process of the session sees: an xdist worker's base temp folder is one of the controller's."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _trained_once(backend: str, folder: Path) -> Reference:
    """`backend`'s reference from `folder`, trained there first by whichever process gets its lock first; the others
    wait for its files (a reference costs more than the wait), or for its failure (not trained again by each)."""
    folder.mkdir(exist_ok=True)
    output_dir, done, failed = folder / backend, folder / f"{backend}.done", folder / f"{backend}.failed"
    with open(folder / f"{backend}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when its process dies
        if failed.exists():
            raise RuntimeError(f"the {backend} reference run failed in another process: {failed.read_text()}")
        if done.exists():
            return Reference(output_dir, read_metrics(output_dir / "test" / "metrics.jsonl"))
        shutil.rmtree(output_dir, ignore_errors=True)  # what a process that died training it left
        output_dir.mkdir()
        own_ray = not ray.is_initialized()
        if own_ray:
            ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING")
        try:
            reference = train_reference(output_dir, reference_config(output_dir, backend))
        except Exception as exc:
            failed.write_text(repr(exc))
            raise
        finally:
            if own_ray:
                ray.shutdown()
        done.touch()
        return reference
