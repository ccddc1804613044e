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
