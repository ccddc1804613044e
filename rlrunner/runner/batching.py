"""Driver-side batch plumbing: pure functions from the step's prompts and samples to per-worker arguments."""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

import torch

T = TypeVar("T")


def chunk(items: Sequence[T], size: int) -> list[list[T]]:
    """Consecutive pieces of `size` items (the last may be shorter)."""
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def split_evenly(items: Sequence[T], parts: int) -> list[list[T]]:
    """`parts` consecutive pieces whose sizes differ by at most one (earlier pieces are the larger)."""
    base, extra = divmod(len(items), parts)
    pieces, start = [], 0
    for part in range(parts):
        size = base + (1 if part < extra else 0)
        pieces.append(list(items[start : start + size]))
        start += size
    return pieces


def generation_chunking(cfg: Any, validation: bool) -> tuple[int, int]:
    """(samples per prompt, prompts per chunk) of a generation: `algorithm.group_size` and
    `rollout.generation_batch_size` in training; a validation chunk holds as many rows as a training one."""
    rollout, group = cfg.rollout, cfg.algorithm.group_size
    if not validation:
        return group, rollout.generation_batch_size
    per_prompt = rollout.val.num_samples
    return per_prompt, max(1, rollout.generation_batch_size * group // per_prompt)


def first_samples(assignment: Sequence[Sequence[Sequence[Any]]], per_prompt: int) -> list[int]:
    """The position in the step's samples of each worker's first sample, for its chunks of prompts."""
    starts = [0]
    for part in assignment[:-1]:
        starts.append(starts[-1] + sum(len(c) for c in part) * per_prompt)
    return starts


def build_actor_batch(
    samples: Sequence[dict[str, Any]], advantages: torch.Tensor, pad_id: int
) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response rows with a mask over the response's target positions.

    input_ids [N, L]; loss_mask [N, L-1] is 1.0 where the token predicted at that position
    (input_ids[:, t+1]) belongs to the response; lengths [N]; advantages [N]; rollout_logprobs [N, L-1],
    the rollout engine's log-probability of each response token at its target position (0 elsewhere).
    """
    if any(not s["prompt_ids"] for s in samples):
        raise ValueError("a sample has an empty prompt: its first response token would have nothing to condition on")
    lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
    width = max(lengths)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(samples), width - 1), dtype=torch.float32)
    rollout_logprobs = torch.zeros((len(samples), width - 1), dtype=torch.float32)
    for row, sample in enumerate(samples):
        prompt_len, total = len(sample["prompt_ids"]), lengths[row]
        input_ids[row, :total] = torch.tensor(
            list(sample["prompt_ids"]) + list(sample["response_ids"]), dtype=torch.long
        )
        loss_mask[row, prompt_len - 1 : total - 1] = 1.0
        rollout_logprobs[row, prompt_len - 1 : total - 1] = torch.tensor(sample["logprobs"], dtype=torch.float32)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "lengths": torch.tensor(lengths, dtype=torch.long),
        "advantages": advantages.to(torch.float32),
        "rollout_logprobs": rollout_logprobs,
    }


def shard_actor_batch(
    batch: dict[str, torch.Tensor], num_ranks: int, num_minibatches: int
) -> list[dict[str, torch.Tensor]]:
    """Rank r's rows: its equal slice of every mini-batch, mini-batches in order.

    Each shard also carries `token_counts` and `sequence_counts` [num_minibatches]: the response tokens, and the
    sequences with at least one, of each whole mini-batch on all ranks (the loss aggregation's denominators).
    """
    rows = batch["input_ids"].shape[0]
    if rows % (num_ranks * num_minibatches):
        raise ValueError(f"{rows} rows do not split into {num_minibatches} mini-batches x {num_ranks} ranks")
    per_minibatch = rows // num_minibatches
    per_rank = per_minibatch // num_ranks
    token_counts = batch["loss_mask"].view(num_minibatches, -1).sum(dim=1)
    sequence_counts = (batch["loss_mask"].sum(dim=1) > 0).float().view(num_minibatches, -1).sum(dim=1)
    shards = []
    for rank in range(num_ranks):
        index = torch.cat(
            [
                torch.arange(mb * per_minibatch + rank * per_rank, mb * per_minibatch + (rank + 1) * per_rank)
                for mb in range(num_minibatches)
            ]
        )
        shard = {key: value[index] for key, value in batch.items()}
        shard["token_counts"] = token_counts.clone()
        shard["sequence_counts"] = sequence_counts.clone()
        shards.append(shard)
    return shards
