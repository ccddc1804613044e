"""The rollout worker: hosts one rollout engine, turns the driver's prompts into scored samples, takes weights.

The driver fixes the chunks of prompts; each sample's seed comes from (run seed, step, prompt index, sample
index), so what a sample gets does not depend on which worker generated it. Every response is scored here, in
one place, with the run's reward function, whatever the engine: in the worker's scoring processes
(`rlrunner.rewards.scorer`), each chunk as soon as the engine has it, so scoring overlaps the next chunk's generation.
With `rollout.multi_turn` a sample is a trajectory of turns and what answered them (`rlrunner.rollout.multi_turn`):
its tools or environment run in the worker's tool processes, every answer recorded in the driver's call ledger.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rlrunner.agents.settings import MultiTurnSettings
from rlrunner.cluster.node import node_ip
from rlrunner.cluster.worker import Worker
from rlrunner.errors import ConfigError, RewardFunctionError
from rlrunner.models.loading import build_tokenizer, token_ids
from rlrunner.rewards.scorer import RewardSettings, Score, ScoreRequest
from rlrunner.rollout.base import SampleRequest, Sampling
from rlrunner.rollout.registry import get_engine
from rlrunner.utils.seeding import derive_seed
from rlrunner.utils.user_code import CodeLoadError
from rlrunner.weight_sync.channels import connect_store
from rlrunner.weight_sync.transport import WeightReceiver


class RolloutWorker(Worker):
    def __init__(
        self,
        rank: int,
        world_size: int,
        model_cfg: dict[str, Any],
        rollout_cfg: dict[str, Any],
        group_size: int,
        reward: RewardSettings,
        seed: int,
        max_prompt_length: int = 512,
        threads: int = 1,
        use_gpu: bool = False,
        multi_turn: MultiTurnSettings | None = None,
    ):
        super().__init__(rank, world_size, threads, use_gpu)
        self.group_size = group_size
        self.seed = seed
        self.tokenizer = build_tokenizer(model_cfg)
        self.token_ids = token_ids(model_cfg, self.tokenizer)
        self.reward = reward
        self.val_samples = rollout_cfg["val"]["num_samples"]
        self.sampling = {"train": Sampling.training(rollout_cfg), "val": Sampling.validation(rollout_cfg)}
        self.scorer = reward.scorer()  # its processes start now, beside the engine's build
        engine = get_engine(rollout_cfg["engine"])
        self.engine = engine(
            model_cfg, rollout_cfg, self.tokenizer, self.token_ids, seed, self.device, max_prompt_length
        )
        self.weight_sync: WeightReceiver | None = None
        self.turns = None if multi_turn is None else self._multi_turn(multi_turn, seed)

    def _multi_turn(self, settings: MultiTurnSettings, seed: int):
        from rlrunner.agents.environments import ToolEnvironments, UserEnvironments
        from rlrunner.rollout.multi_turn import MultiTurnRollout

        pool = settings.pool()  # its processes start now, beside the engine's
        if settings.tools is not None:
            environments = ToolEnvironments(pool, settings, settings.load_parser(), self.tokenizer)
        else:
            environments = UserEnvironments(pool, settings)
        return MultiTurnRollout(self.engine, self.tokenizer, self.token_ids, settings, environments, seed)

    def generate(
        self,
        step: int,
        chunks: list[list[dict[str, Any]]],
        first_sample: int = 0,
        validation: bool = False,
        ledger: Any = None,
    ) -> list[dict[str, Any]]:
        """Scored samples, in prompt order, for each chunk of prompts: `group_size` per prompt, or with `validation`
        `rollout.val.num_samples` sampled the `rollout.val.*` way. `first_sample` is the position of this call's first
        sample in the step's batch (what a reward error names, and a tool call's key); `ledger`: the run's call ledger
        (a multi-turn run's), where every tool result is recorded."""
        mode = "val" if validation else "train"
        per_prompt = self.val_samples if validation else self.group_size
        rows = [[(record, j) for record in chunk for j in range(per_prompt)] for chunk in chunks]
        if self.turns is None:
            samples, batches = self._generate_once(step, rows, mode)
        else:
            samples, batches = self._generate_turns(step, rows, mode, first_sample, ledger)
        if validation:
            self.engine.reset_cache()
        scores = self._scores(batches, stop_at_error=self.reward.on_error == "raise")
        for position, (sample, score) in enumerate(zip(samples, scores)):
            if score.error is not None and self.reward.on_error == "raise":
                where = "validation at step" if validation else "step"
                raise RewardFunctionError(
                    f"reward function {self.reward.spec.text} failed at {where} {step}, "
                    f"sample {first_sample + position} "
                    f"(prompt {sample['index']}, response {sample['sample']}): {score.error}"
                )
            sample["reward"] = score.value if score.error is None else 0.0
            sample["reward_error"] = score.error is not None
            sample["reward_extras"] = score.extras
        return samples

    def _generate_once(self, step: int, rows: list[list[tuple[dict, int]]], mode: str) -> tuple[list, list]:
        """A single-turn generation: the samples, and each chunk's scoring in flight."""
        seed_name = "val_sample" if mode == "val" else "sample"  # validation draws apart from training
        requests = [
            [
                SampleRequest(record["prompt_ids"], derive_seed(self.seed, seed_name, step, record["index"], j))
                for record, j in chunk
            ]
            for chunk in rows
        ]
        samples: list[dict[str, Any]] = []
        batches = []
        for chunk, completions in zip(rows, self.engine.iter_generate(requests, self.sampling[mode])):
            scoring = []
            for (record, j), completion in zip(chunk, completions):
                response = list(completion.token_ids)
                samples.append(
                    {
                        "index": record["index"],
                        "sample": j,
                        "prompt_ids": record["prompt_ids"],
                        "response_ids": response,
                        "logprobs": list(completion.logprobs),
                        "finished": bool(response) and response[-1] in self.token_ids.eos,
                        "data_source": record["data_source"],
                    }
                )
                text = self.tokenizer.decode(response, skip_special_tokens=True)
                scoring.append(ScoreRequest(record["data_source"], text, record["answer"], record["extra_info"]))
            batches.append(([None] * len(scoring), self.scorer.submit(scoring)))  # scored while the next generates
        return samples, batches

    def _generate_turns(
        self, step: int, rows: list[list[tuple[dict, int]]], mode: str, first_sample: int, ledger: Any
    ) -> tuple[list, list]:
        """A multi-turn generation: the trajectories as samples, and each chunk's scoring, started as the chunk ends.
        A trajectory whose environment gave a reward of its own is scored by it, unless `reward.function` is set (it
        then sees that reward in the trajectory)."""
        from rlrunner.rollout.call_records import LedgerActorRecorder, LocalRecorder

        if ledger is None:
            recorder = self._local_records = getattr(self, "_local_records", None) or LocalRecorder()
        else:
            recorder = LedgerActorRecorder(ledger, self.owner)
        own_function = self.reward.spec.key == "reward.function"
        batches = []  # (the chunk's first position, its scores known already, its scoring batch), as chunks end

        def score(trajectories: list) -> None:
            ready: list[Score | None] = []
            requests = []
            for trajectory in trajectories:
                record = trajectory.record
                if trajectory.env_reward is not None and not own_function:
                    ready.append(Score(trajectory.env_reward))
                    continue
                ready.append(None)
                prompt = self.tokenizer.decode(record["prompt_ids"], skip_special_tokens=True)
                info = {**record["extra_info"], "trajectory": trajectory.for_reward(prompt)}
                solution = trajectory.texts[-1] if trajectory.texts else ""
                requests.append(ScoreRequest(record["data_source"], solution, record["answer"], info))
            batches.append((trajectories[0].position, ready, self.scorer.submit(requests)))

        sampling = self.sampling[mode]
        trajectories = self.turns.run(recorder, mode, step, rows, first_sample, sampling, score)
        samples = [
            {
                "index": t.record["index"],
                "sample": t.sample,
                "prompt_ids": t.prompt_ids,
                "response_ids": t.response,
                "response_mask": t.mask,
                "logprobs": t.logprobs,
                "finished": t.ended == "done",
                "data_source": t.record["data_source"],
                "agent": t.summary(),
            }
            for t in trajectories
        ]
        return samples, [(ready, batch) for _, ready, batch in sorted(batches, key=lambda entry: entry[0])]

    @property
    def owner(self) -> str:
        """This worker as the call ledger knows it: its Ray actor's id (unique to this process)."""
        import ray

        return ray.get_runtime_context().get_actor_id() or f"pid {os.getpid()}"

    def _scores(self, chunks: list[tuple[list[Score | None], Any]], stop_at_error: bool) -> list[Score]:
        """The scores of each chunk, in order: those known already (an environment's reward), the rest from its
        scoring batch; with `stop_at_error`, only up to the first error (the rest dropped)."""
        scores: list[Score] = []
        try:
            for ready, batch in chunks:
                scored = iter(self.scorer.wait(batch, until_error=stop_at_error))
                for known in ready:
                    found = known if known is not None else next(scored)
                    scores.append(found)
                    if stop_at_error and found.error is not None:
                        self.scorer.discard([batch for _, batch in chunks])
                        return scores
        except CodeLoadError as exc:
            raise ConfigError(str(exc)) from None
        return scores

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full HF-layout weights passed in whole (the path before the collective weight sync; benchmarks)."""
        sink = self.engine.weight_sink()
        for spec in sink.layout():
            target = sink.target(spec)
            with torch.no_grad():
                target.copy_(state_dict[spec.name])
            sink.load(spec.name, target)
        sink.finish()

    # -- weight sync (see rlrunner.weight_sync) --------------------------------------------------

    def join_weight_sync(
        self, host: str, port: int, num_actor_ranks: int, num_rollout_workers: int, timeout_s: float
    ) -> list[str]:
        """Collective with every actor rank and rollout worker: join all actor ranks' channels; returns their
        backends."""
        if num_rollout_workers != self.world_size:
            raise ValueError(
                f"join_weight_sync: {num_rollout_workers} rollout workers given, the group has {self.world_size}"
            )
        self.close_weight_sync()
        store = connect_store(host, port, timeout_s)
        self.weight_sync = WeightReceiver(
            store,
            self.rank,
            num_actor_ranks,
            num_rollout_workers,
            self.engine.weight_sink(),
            self.device,
            timeout_s,
            node_ip(),
        )
        return self.weight_sync.backends

    def receive_weights(self, bucket_bytes: int) -> dict[str, float]:
        """Collective with every actor rank's `send_weights`: receive the weights into this worker's engine."""
        if self.weight_sync is None:
            raise RuntimeError("receive_weights before join_weight_sync")
        return self.weight_sync.receive(bucket_bytes)

    def close_weight_sync(self) -> None:
        sync, self.weight_sync = self.weight_sync, None
        if sync is not None:
            sync.close()

    def close(self) -> None:
        self.close_weight_sync()
        self.scorer.close()
        if self.turns is not None:
            self.turns.environments.close()
        self.engine.close()
