"""The rollout worker: a full copy of the policy that samples responses and scores them."""

from __future__ import annotations

from typing import Any

import torch

from rlrunner.cluster.worker import Worker
from rlrunner.models.loading import build_model, build_tokenizer, token_ids
from rlrunner.rewards import get_reward_fn
from rlrunner.utils.seeding import derive_seed
from rlrunner.workers.sampling import generate


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
        threads: int = 1,
        use_gpu: bool = False,
    ):
        super().__init__(rank, world_size, threads, use_gpu)
        self.rollout_cfg = rollout_cfg
        self.group_size = group_size
        self.seed = seed
        self.tokenizer = build_tokenizer(model_cfg)
        self.token_ids = token_ids(model_cfg, self.tokenizer)
        # The initial weights do not matter: the actor's are loaded before the first generation.
        self.model = build_model(model_cfg, self.tokenizer, seed).to(self.device).eval()
        self.reward_fn = get_reward_fn(verifier)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict, strict=True)

    # -- weight sync (see rlrunner.workers.weight_sync) ----------------------------------------

    def join_weight_sync(self, host: str, port: int, num_actor_ranks: int, num_rollout_workers: int, timeout_s: float) -> list[str]:
        """Collective with every actor rank and rollout worker: join all actor ranks' channels; returns their backends."""
        from rlrunner.cluster.worker import node_ip
        from rlrunner.workers.weight_sync import RolloutSync, connect_store

        if num_rollout_workers != self.world_size:
            raise ValueError(f"join_weight_sync: {num_rollout_workers} rollout workers given, the group has {self.world_size}")
        self.close_weight_sync()
        store = connect_store(host, port, timeout_s)
        self.weight_sync = RolloutSync(
            store, self.rank, num_actor_ranks, num_rollout_workers, self._weight_sync_state(), self.device, timeout_s, node_ip()
        )
        return self.weight_sync.backends

    def receive_weights(self, bucket_bytes: int) -> dict[str, float]:
        """Collective with every actor rank's `send_weights`: receive the weights into this worker's model."""
        if getattr(self, "weight_sync", None) is None:
            raise RuntimeError("receive_weights before join_weight_sync")
        return self.weight_sync.receive(self._weight_sync_state(), bucket_bytes)

    def close_weight_sync(self) -> None:
        sync, self.weight_sync = getattr(self, "weight_sync", None), None
        if sync is not None:
            sync.close()

    def _weight_sync_state(self) -> dict[str, torch.Tensor]:
        """The model's own tensors by state-dict name (what `load_weights` fills), written in place by the sync."""
        return self.model.state_dict(keep_vars=True)

    def generate(self, step: int, chunks: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """`group_size` scored samples per prompt, in prompt order, for each chunk of prompts.

        A chunk is generated as one padded batch; the chunks are fixed by the driver, so the
        result does not depend on how many rollout workers share the step.
        """
        samples: list[dict[str, Any]] = []
        for chunk in chunks:
            rows = [(record, j) for record in chunk for j in range(self.group_size)]
            responses = generate(
                self.model,
                prompts=[record["prompt_ids"] for record, _ in rows],
                seeds=[derive_seed(self.seed, "sample", step, record["index"], j) for record, j in rows],
                max_new_tokens=self.rollout_cfg["max_new_tokens"],
                temperature=self.rollout_cfg["temperature"],
                top_p=self.rollout_cfg["top_p"],
                pad_id=self.token_ids.pad,
                eos_ids=self.token_ids.eos,
            )
            for (record, j), response in zip(rows, responses):
                finished = bool(response) and response[-1] in self.token_ids.eos
                text = self.tokenizer.decode(response, skip_special_tokens=True)
                samples.append(
                    {
                        "index": record["index"],
                        "sample": j,
                        "prompt_ids": record["prompt_ids"],
                        "response_ids": response,
                        "finished": finished,
                        "reward": float(self.reward_fn(text, record["answer"])),
                    }
                )
        return samples
