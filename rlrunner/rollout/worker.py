"""The rollout worker: hosts one rollout engine, turns the driver's prompts into scored samples, takes weights.

The driver fixes the chunks of prompts; each sample's seed comes from (run seed, step, prompt index, sample
index), so what a sample gets does not depend on which worker generated it. Every response is scored here, in
one place, with the run's reward function, whatever the engine.
"""

from __future__ import annotations

from typing import Any

import torch

from rlrunner.cluster.node import node_ip
from rlrunner.cluster.worker import Worker
from rlrunner.models.loading import build_tokenizer, token_ids
from rlrunner.rewards import get_reward_fn
from rlrunner.rollout.base import SampleRequest
from rlrunner.rollout.registry import get_engine
from rlrunner.utils.seeding import derive_seed
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
        verifier: str,
        seed: int,
        max_prompt_length: int = 512,
        threads: int = 1,
        use_gpu: bool = False,
    ):
        super().__init__(rank, world_size, threads, use_gpu)
        self.group_size = group_size
        self.seed = seed
        self.tokenizer = build_tokenizer(model_cfg)
        self.token_ids = token_ids(model_cfg, self.tokenizer)
        self.reward_fn = get_reward_fn(verifier)
        engine = get_engine(rollout_cfg["engine"])
        self.engine = engine(model_cfg, rollout_cfg, self.tokenizer, self.token_ids, seed, self.device, max_prompt_length)
        self.weight_sync: WeightReceiver | None = None

    def generate(self, step: int, chunks: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """`group_size` scored samples per prompt, in prompt order, for each chunk of prompts."""
        rows = [[(record, j) for record in chunk for j in range(self.group_size)] for chunk in chunks]
        requests = [
            [SampleRequest(record["prompt_ids"], derive_seed(self.seed, "sample", step, record["index"], j)) for record, j in chunk]
            for chunk in rows
        ]
        responses = self.engine.generate(requests)
        samples: list[dict[str, Any]] = []
        for chunk, completions in zip(rows, responses):
            for (record, j), completion in zip(chunk, completions):
                response = list(completion.token_ids)
                samples.append({
                    "index": record["index"],
                    "sample": j,
                    "prompt_ids": record["prompt_ids"],
                    "response_ids": response,
                    "logprobs": list(completion.logprobs),
                    "finished": bool(response) and response[-1] in self.token_ids.eos,
                })
        self._score(samples, [record["answer"] for chunk in rows for record, _ in chunk])
        return samples

    def _score(self, samples: list[dict[str, Any]], answers: list[Any]) -> None:
        """Each sample's reward: the reward function on its decoded response and its prompt's answer."""
        for sample, answer in zip(samples, answers):
            text = self.tokenizer.decode(sample["response_ids"], skip_special_tokens=True)
            sample["reward"] = float(self.reward_fn(text, answer))

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

    def join_weight_sync(self, host: str, port: int, num_actor_ranks: int, num_rollout_workers: int, timeout_s: float) -> list[str]:
        """Collective with every actor rank and rollout worker: join all actor ranks' channels; returns their backends."""
        if num_rollout_workers != self.world_size:
            raise ValueError(f"join_weight_sync: {num_rollout_workers} rollout workers given, the group has {self.world_size}")
        self.close_weight_sync()
        store = connect_store(host, port, timeout_s)
        self.weight_sync = WeightReceiver(
            store, self.rank, num_actor_ranks, num_rollout_workers, self.engine.weight_sink(), self.device, timeout_s, node_ip()
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
        self.engine.close()
