"""Driver-side batch plumbing: pure functions from the step's prompts and samples to per-worker arguments."""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

import torch

from rlrunner.backends.tree_sum import is_power_of_two

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
    (input_ids[:, t+1]) belongs to the response, and is the model's own (`response_mask`, a multi-turn trajectory's:
    0 on what answered its turns); lengths [N] and prompt_lengths [N] (the update packs rows that share a
    prompt: rlrunner.backends.prompt_packing); advantages [N]; rollout_logprobs [N, L-1],
    the rollout engine's log-probability of each response token at its target position (0 elsewhere).
    """
    if any(not s["prompt_ids"] for s in samples):
        raise ValueError("a sample has an empty prompt: its first response token would have nothing to condition on")
    lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
    width = max(lengths)
    # Padded Python rows, each made a tensor once: a copy per row into preallocated tensors cost the driver about
    # 10 ms per step of the default job (256 rows), between the generation and the update.
    id_rows, logprob_rows, mask_rows = [], [], []
    masked = any("response_mask" in s for s in samples)
    for sample, total in zip(samples, lengths):
        prompt, response = list(sample["prompt_ids"]), list(sample["response_ids"])
        logprobs = sample["logprobs"]
        logprobs = logprobs.tolist() if isinstance(logprobs, torch.Tensor) else list(logprobs)
        if len(logprobs) != len(response):
            raise ValueError(f"a sample has {len(response)} response tokens but {len(logprobs)} log-probabilities")
        id_rows.append(prompt + response + [pad_id] * (width - total))
        logprob_rows.append([0.0] * (len(prompt) - 1) + logprobs + [0.0] * (width - total))
        if masked:
            mask = [float(m) for m in sample.get("response_mask", [1] * len(response))]
            if len(mask) != len(response):
                raise ValueError(f"a sample has {len(response)} response tokens but a mask of {len(mask)}")
            mask_rows.append([0.0] * (len(prompt) - 1) + mask + [0.0] * (width - total))
    input_ids = torch.tensor(id_rows, dtype=torch.long)
    rollout_logprobs = torch.tensor(logprob_rows, dtype=torch.float32).view(len(samples), width - 1)
    starts = torch.tensor([len(s["prompt_ids"]) - 1 for s in samples]).unsqueeze(1)
    position = torch.arange(width - 1).unsqueeze(0)
    if masked:
        loss_mask = torch.tensor(mask_rows, dtype=torch.float32).view(len(samples), width - 1)
    else:
        loss_mask = ((position >= starts) & (position < torch.tensor(lengths).unsqueeze(1) - 1)).to(torch.float32)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "lengths": torch.tensor(lengths, dtype=torch.long),
        "prompt_lengths": starts.view(-1) + 1,
        "advantages": advantages.to(torch.float32),
        "rollout_logprobs": rollout_logprobs,
    }


def greedy_micro_batches(lengths: Sequence[int], max_rows: int | None, max_tokens: int | None) -> list[int]:
    """The row counts of consecutive micro-batches over rows of these `lengths`, each as long as it can be: at most
    `max_rows` rows and `max_tokens` padded tokens (its rows x its longest row); a row longer than `max_tokens` is a
    micro-batch of its own. None: no such limit."""
    sizes: list[int] = []
    rows, width = 0, 0
    for length in lengths:
        wider = max(width, int(length))
        fits = (max_rows is None or rows + 1 <= max_rows) and (max_tokens is None or (rows + 1) * wider <= max_tokens)
        if rows and not fits:
            sizes.append(rows)
            rows, wider = 0, int(length)
        rows, width = rows + 1, wider
    if rows:
        sizes.append(rows)
    return sizes


def split_to_count(sizes: Sequence[int], count: int) -> list[int]:
    """`sizes` made `count` micro-batches (count >= len(sizes), at most their rows): the first of the largest is cut
    in two (its larger half first) until there are that many. Every rank of a mini-batch must run the same number of
    forward/backward passes: FSDP's and tensor parallelism's collectives run once per pass."""
    sizes = list(sizes)
    if not len(sizes) <= count <= sum(sizes):
        raise ValueError(f"{sum(sizes)} rows in {len(sizes)} micro-batches cannot be made {count}")
    while len(sizes) < count:
        largest = sizes.index(max(sizes))
        rows = sizes[largest]
        sizes[largest : largest + 1] = [rows - rows // 2, rows // 2]
    return sizes


def plan_micro_batches(
    lengths: Sequence[Sequence[int]], max_rows: int | None, max_tokens: int | None
) -> list[list[int]]:
    """Each rank's micro-batches (row counts) over its rows of one mini-batch (`lengths[rank]`): greedy under the
    limits, then every rank brought to the count of the rank that needs the most."""
    greedy = [greedy_micro_batches(rank_lengths, max_rows, max_tokens) for rank_lengths in lengths]
    count = max(len(sizes) for sizes in greedy)
    return [split_to_count(sizes, count) for sizes in greedy]


def logical_micro_batches(lengths: Sequence[int], max_rows: int | None, max_tokens: int | None, min_count: int) -> int:
    """How many equal blocks of consecutive rows a layout-invariant update splits a mini-batch of rows of these
    `lengths` into, whatever the data-parallel size: the smallest power of two, at least `min_count` (the largest
    data-parallel size the run may have), that divides the rows and under which every block fits `max_rows` rows and
    `max_tokens` padded tokens; the largest power of two dividing the rows when none does (a block may then pass
    `max_tokens`: a pass can be no smaller than its block)."""
    rows = len(lengths)
    largest = rows & -rows  # the largest power of two dividing rows

    def fits(count: int) -> bool:
        size = rows // count
        return (max_rows is None or size <= max_rows) and (
            max_tokens is None or all(size * max(lengths[i : i + size]) <= max_tokens for i in range(0, rows, size))
        )

    count = 1
    while count < min_count:
        count *= 2
    if count > largest:
        raise ValueError(f"{rows} rows do not split into {count} equal logical micro-batches")
    while count < largest and not fits(count):
        count *= 2
    return count


def layout_invariant_plan(
    lengths: Sequence[Sequence[int]], max_rows: int | None, max_tokens: int | None, min_count: int
) -> list[list[int]]:
    """Each rank's micro-batches (row counts) over its rows of one mini-batch (`lengths[rank]`) for a layout-invariant
    update: the mini-batch's logical micro-batches (`logical_micro_batches`), the same whatever the number of ranks,
    each rank running its contiguous block of them. Raises ValueError when the ranks do not divide them."""
    ranks = len(lengths)
    rows = [length for rank_lengths in lengths for length in rank_lengths]
    count = logical_micro_batches(rows, max_rows, max_tokens, min_count)
    if not is_power_of_two(ranks) or count % ranks:
        raise ValueError(
            f"{ranks} data-parallel ranks do not divide the mini-batch's {count} logical micro-batches "
            "(actor.layout_invariant needs a power-of-two size up to the configured one)"
        )
    return [[len(rows) // count] * (count // ranks) for _ in range(ranks)]


def shard_actor_batch(
    batch: dict[str, torch.Tensor],
    num_ranks: int,
    num_minibatches: int,
    micro_batch_rows: int | None = None,
    micro_batch_tokens: int | None = None,
    invariant_min_count: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Rank r's rows: its equal slice of every mini-batch, mini-batches in order.

    Each shard also carries `token_counts` and `sequence_counts` [num_minibatches]: the response tokens, and the
    sequences with at least one, of each whole mini-batch on all ranks (the loss aggregation's denominators); and
    `micro_batches`: the row count of each of its micro-batches, mini-batch after mini-batch (`plan_micro_batches`
    under `micro_batch_rows` and `micro_batch_tokens`; with neither, one per mini-batch). With `invariant_min_count`
    (a layout-invariant update, `layout_invariant_plan`) the micro-batches are the mini-batch's logical ones, the same
    rows whatever `num_ranks`.
    """
    rows = batch["input_ids"].shape[0]
    if rows % (num_ranks * num_minibatches):
        raise ValueError(f"{rows} rows do not split into {num_minibatches} mini-batches x {num_ranks} ranks")
    per_minibatch = rows // num_minibatches
    per_rank = per_minibatch // num_ranks
    token_counts = batch["loss_mask"].view(num_minibatches, -1).sum(dim=1)
    sequence_counts = (batch["loss_mask"].sum(dim=1) > 0).float().view(num_minibatches, -1).sum(dim=1)
    lengths = batch["lengths"].view(num_minibatches, num_ranks, per_rank).tolist()
    if invariant_min_count is None:
        plans = [plan_micro_batches(minibatch, micro_batch_rows, micro_batch_tokens) for minibatch in lengths]
    else:
        plans = [
            layout_invariant_plan(minibatch, micro_batch_rows, micro_batch_tokens, invariant_min_count)
            for minibatch in lengths
        ]
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
        shard["micro_batches"] = torch.tensor([rows for plan in plans for rows in plan[rank]], dtype=torch.long)
        shards.append(shard)
    return shards
