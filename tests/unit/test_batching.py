"""Driver-side batch plumbing: chunking, padding, loss masks and per-rank shards."""

import pytest
import torch

from rlrunner.backends.base import RankMap
from rlrunner.runner.batching import (
    build_actor_batch,
    chunk,
    greedy_micro_batches,
    plan_micro_batches,
    shard_actor_batch,
    split_evenly,
    split_to_count,
)

from conftest import assert_bit_equal

# --- chunk / split_evenly ---------------------------------------------------------


def test_chunk_consecutive_pieces_last_shorter() -> None:
    assert chunk(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert chunk(list(range(6)), 3) == [[0, 1, 2], [3, 4, 5]]
    assert chunk([], 3) == []
    assert chunk("abcde", 2) == [["a", "b"], ["c", "d"], ["e"]]


def test_split_evenly_sizes_order_and_earlier_larger() -> None:
    pieces = split_evenly(list(range(10)), 4)
    # 10 = 3 + 3 + 2 + 2
    assert pieces == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert [x for piece in pieces for x in piece] == list(range(10))


@pytest.mark.parametrize(("n", "parts"), [(0, 3), (1, 1), (5, 5), (7, 3), (11, 4), (16, 4), (100, 7)])
def test_split_evenly_invariants(n: int, parts: int) -> None:
    pieces = split_evenly(list(range(n)), parts)
    sizes = [len(p) for p in pieces]
    assert len(pieces) == parts
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert [x for piece in pieces for x in piece] == list(range(n))


def test_split_evenly_more_parts_than_items() -> None:
    assert split_evenly(["a", "b"], 4) == [["a"], ["b"], [], []]


# --- build_actor_batch ------------------------------------------------------------

SAMPLES = [
    {"prompt_ids": [5, 6], "response_ids": [7, 8, 9], "logprobs": [-0.5, -1.5, -2.5]},  # length 5
    {"prompt_ids": [10, 11, 12], "response_ids": [13], "logprobs": [-3.0]},  # length 4
    {"prompt_ids": [14], "response_ids": [15, 16], "logprobs": [-0.25, -0.75]},  # length 3
]


def sample(prompt_ids: list[int], response_ids: list[int]) -> dict:
    return {"prompt_ids": prompt_ids, "response_ids": response_ids, "logprobs": [-1.0] * len(response_ids)}


def test_build_actor_batch_padding_mask_lengths() -> None:
    batch = build_actor_batch(SAMPLES, torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64), pad_id=99)
    assert torch.equal(
        batch["input_ids"],
        torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 99], [14, 15, 16, 99, 99]]),
    )
    assert batch["input_ids"].dtype == torch.long
    # loss_mask[t] = 1 where input_ids[t+1] is a response token:
    # row 0: targets 6,7,8,9 -> [0,1,1,1]; row 1: targets 11,12,13,pad -> [0,0,1,0];
    # row 2: targets 15,16,pad,pad -> [1,1,0,0]
    expected_mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    assert torch.equal(batch["loss_mask"], expected_mask)
    assert batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["lengths"], torch.tensor([5, 4, 3]))
    assert batch["lengths"].dtype == torch.long
    assert batch["advantages"].dtype == torch.float32
    assert torch.equal(batch["advantages"], torch.tensor([0.5, -1.0, 2.0]))


def test_build_actor_batch_mask_marks_exactly_response_targets() -> None:
    batch = build_actor_batch(SAMPLES, torch.zeros(3), pad_id=0)
    for row, sample in enumerate(SAMPLES):
        prompt_len = len(sample["prompt_ids"])
        total = prompt_len + len(sample["response_ids"])
        marked = batch["loss_mask"][row].nonzero().flatten().tolist()
        # the target of position t is input_ids[t+1]; response tokens sit at [prompt_len, total)
        assert marked == [t for t in range(batch["loss_mask"].shape[1]) if prompt_len <= t + 1 < total]
        assert [int(batch["input_ids"][row, t + 1]) for t in marked] == sample["response_ids"]
        # the rollout's log-prob of each response token sits at that token's target position, 0 elsewhere
        assert batch["rollout_logprobs"][row, marked].tolist() == sample["logprobs"]
        assert batch["rollout_logprobs"][row].count_nonzero() == len(marked)
    # the mask's total equals the number of response tokens
    assert batch["loss_mask"].sum().item() == 3 + 1 + 2


def test_build_actor_batch_empty_response_has_no_loss_tokens() -> None:
    samples = [sample([1, 2, 3], []), sample([4], [5, 6])]
    batch = build_actor_batch(samples, torch.zeros(2), pad_id=0)
    assert torch.equal(batch["input_ids"], torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert torch.equal(batch["loss_mask"], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))


# --- shard_actor_batch --------------------------------------------------------------


def _eight_row_batch() -> dict[str, torch.Tensor]:
    samples = [sample([100 + i], [1] * (i % 3 + 1)) for i in range(8)]
    return build_actor_batch(samples, torch.arange(8, dtype=torch.float32), pad_id=0)


def test_shard_rows_per_rank_and_minibatch() -> None:
    batch = _eight_row_batch()
    shards = shard_actor_batch(batch, num_ranks=2, num_minibatches=2)
    assert len(shards) == 2
    # rows are identified by their first token 100+i
    assert shards[0]["input_ids"][:, 0].tolist() == [100, 101, 104, 105]
    assert shards[1]["input_ids"][:, 0].tolist() == [102, 103, 106, 107]
    assert shards[0]["advantages"].tolist() == [0.0, 1.0, 4.0, 5.0]
    assert shards[1]["advantages"].tolist() == [2.0, 3.0, 6.0, 7.0]
    keys = ("input_ids", "loss_mask", "lengths", "advantages")  # the per-row tensors (a shard holds more)
    for shard, rows in zip(shards, ([0, 1, 4, 5], [2, 3, 6, 7])):
        assert_bit_equal({key: shard[key] for key in keys}, {key: batch[key][rows] for key in keys})


def test_shard_token_counts_are_per_minibatch_totals_on_every_rank() -> None:
    batch = _eight_row_batch()
    # response lengths 1,2,3,1,2,3,1,2 -> mini-batch 0 (rows 0-3): 7 tokens, mini-batch 1 (rows 4-7): 8 tokens
    shards = shard_actor_batch(batch, num_ranks=2, num_minibatches=2)
    for shard in shards:
        assert shard["token_counts"].tolist() == [7.0, 8.0]
    assert shards[0]["token_counts"].tolist() == [
        batch["loss_mask"][0:4].sum().item(),
        batch["loss_mask"][4:8].sum().item(),
    ]
    # each shard has its own copy
    shards[0]["token_counts"][0] = -1
    assert shards[1]["token_counts"][0].item() == 7.0


def test_shard_four_ranks_one_minibatch() -> None:
    batch = _eight_row_batch()
    shards = shard_actor_batch(batch, num_ranks=4, num_minibatches=1)
    assert [s["input_ids"][:, 0].tolist() for s in shards] == [[100, 101], [102, 103], [104, 105], [106, 107]]
    for shard in shards:
        assert shard["token_counts"].tolist() == [15.0]


def test_shard_one_rank_four_minibatches() -> None:
    batch = _eight_row_batch()
    (shard,) = shard_actor_batch(batch, num_ranks=1, num_minibatches=4)
    assert shard["input_ids"][:, 0].tolist() == list(range(100, 108))
    # per mini-batch of 2 rows: (1+2), (3+1), (2+3), (1+2)
    assert shard["token_counts"].tolist() == [3.0, 4.0, 5.0, 3.0]


@pytest.mark.parametrize(("ranks", "minibatches"), [(3, 1), (2, 3), (16, 1), (4, 4)])
def test_shard_indivisible_rows_raise(ranks: int, minibatches: int) -> None:
    with pytest.raises(ValueError, match="8 rows"):
        shard_actor_batch(_eight_row_batch(), num_ranks=ranks, num_minibatches=minibatches)


# --- micro-batch plans ------------------------------------------------------------------


def test_greedy_micro_batches_fill_each_up_to_the_token_and_row_limits() -> None:
    lengths = [3, 3, 5, 2, 2, 2, 9, 1]
    # padded tokens: [3, 3] 6 (+5: 3 x 5 = 15 > 10); [5, 2] 10 (+2: 15); [2, 2] 4 (+9: 27); [9] (+1: 18); [1]
    assert greedy_micro_batches(lengths, None, 10) == [2, 2, 2, 1, 1]
    # [3, 3] 6; [5] (+2: 10 > 8); [2, 2, 2] 6; [9], longer than the budget, alone; [1]
    assert greedy_micro_batches(lengths, None, 8) == [2, 1, 3, 1, 1]
    assert greedy_micro_batches(lengths, 2, None) == [2, 2, 2, 2]  # rows only: the fixed-size micro-batches
    assert greedy_micro_batches(lengths, 2, 8) == [2, 1, 2, 1, 1, 1]
    assert greedy_micro_batches(lengths, None, None) == [8]
    assert greedy_micro_batches([], 4, 10) == []


def test_split_to_count_cuts_the_largest_first() -> None:
    assert split_to_count([5, 2], 2) == [5, 2]
    assert split_to_count([5, 2], 3) == [3, 2, 2]
    assert split_to_count([5, 2], 4) == [2, 1, 2, 2]
    assert split_to_count([4], 4) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="cannot be made 5"):
        split_to_count([2, 2], 5)
    with pytest.raises(ValueError, match="cannot be made 1"):
        split_to_count([2, 2], 1)


def test_every_rank_of_a_minibatch_runs_the_same_number_of_micro_batches() -> None:
    # rank 0's rows fit one micro-batch of 8 tokens; rank 1's need three ([4, 4], [8], [1]): rank 0's is cut to three
    assert plan_micro_batches([[2, 2, 2, 2], [4, 4, 8, 1]], None, 8) == [[1, 1, 2], [2, 1, 1]]
    assert plan_micro_batches([[2, 2], [2, 2]], None, 8) == [[2], [2]]


def test_shards_carry_their_micro_batches_per_minibatch() -> None:
    batch = _eight_row_batch()  # rows of 2, 3, 4, 2, 3, 4, 2, 3 tokens
    assert batch["lengths"].tolist() == [2, 3, 4, 2, 3, 4, 2, 3]
    shards = shard_actor_batch(batch, num_ranks=2, num_minibatches=2, micro_batch_tokens=6)
    # mini-batch 0: rank 0 rows [2, 3] -> 2x3 = 6, one; rank 1 rows [4, 2] -> 8 > 6, two: rank 0 cut to two
    # mini-batch 1: rank 0 rows [3, 4] -> two; rank 1 rows [2, 3] -> one, cut to two
    assert [s["micro_batches"].tolist() for s in shards] == [[1, 1, 1, 1], [1, 1, 1, 1]]
    shards = shard_actor_batch(batch, num_ranks=1, num_minibatches=2, micro_batch_tokens=9)
    # rows [2, 3, 4, 2] -> [2, 3] 6, +4 -> 12 > 9: [4, 2] 8; rows [3, 4, 2, 3] -> [3] (+4: 8 ok) [3, 4] 8, +2: 12 > 9
    assert shards[0]["micro_batches"].tolist() == [2, 2, 2, 2]
    assert shard_actor_batch(batch, 2, 1, micro_batch_rows=2)[0]["micro_batches"].tolist() == [2, 2]
    assert shard_actor_batch(batch, 2, 1)[1]["micro_batches"].tolist() == [4]  # no limit: the share in one


def test_build_actor_batch_rejects_log_probs_that_do_not_match_the_response() -> None:
    samples = [sample([1, 2], [3, 4]), {"prompt_ids": [1], "response_ids": [5, 6], "logprobs": [-0.1]}]
    with pytest.raises(ValueError, match="2 response tokens but 1 log-probabilities"):
        build_actor_batch(samples, torch.zeros(2), pad_id=0)


def test_build_actor_batch_rejects_an_empty_prompt() -> None:
    # With no prompt token, nothing predicts the first response token: the dataset drops such prompts,
    # and the batch builder refuses them rather than silently masking the wrong positions.
    samples = [sample([], [7, 8]), sample([1, 2, 3], [4])]
    with pytest.raises(ValueError, match="empty prompt"):
        build_actor_batch(samples, torch.zeros(2), pad_id=0)


def test_rank_map_scatters_by_data_parallel_rank_and_collects_once_per_rank() -> None:
    ranks = RankMap(dp=2, tp=3)  # rank = dp_rank * tp + tp_rank
    assert ranks.world_size == 6
    assert ranks.scatter(["a", "b"]) == ["a", "a", "a", "b", "b", "b"]
    assert ranks.collect([0, 1, 2, 3, 4, 5]) == [0, 3]  # tensor-parallel rank 0 of each data-parallel rank
    assert RankMap(dp=2).scatter(["a", "b"]) == ["a", "b"] and RankMap(dp=2).collect([7, 8]) == [7, 8]
    with pytest.raises(ValueError, match="3 shards for 2 data-parallel ranks"):
        ranks.scatter(["a", "b", "c"])
    with pytest.raises(ValueError, match="5 results for 6 actor ranks"):
        ranks.collect([0, 1, 2, 3, 4])


def test_validation_chunks_hold_as_many_rows_as_training_ones_and_name_their_first_samples():
    from omegaconf import OmegaConf

    from rlrunner.runner.batching import first_samples, generation_chunking

    cfg = OmegaConf.create(
        {"algorithm": {"group_size": 16}, "rollout": {"generation_batch_size": 8, "val": {"num_samples": 4}}}
    )
    assert generation_chunking(cfg, validation=False) == (16, 8)  # 128 rows a chunk
    assert generation_chunking(cfg, validation=True) == (4, 32)  # 32 prompts x 4 samples: 128 rows too
    cfg.rollout.val.num_samples = 1000
    assert generation_chunking(cfg, validation=True) == (1000, 1)  # never an empty chunk
    # three workers' chunks of 2, 1 and 0+1 prompts, 4 samples each
    assert first_samples([[["a", "b"], ["c"]], [["d"]], [[], ["e"]]], 4) == [0, 12, 16]


def test_logical_micro_batches_are_the_same_whatever_the_ranks() -> None:
    from rlrunner.runner.batching import layout_invariant_plan, logical_micro_batches

    lengths = [5, 9, 3, 7, 5, 5, 12, 4, 6, 6, 6, 6, 8, 3, 2, 9]
    assert logical_micro_batches(lengths, 4, None, 1) == 4  # the row limit
    assert logical_micro_batches(lengths, None, 24, 1) == 8  # 2 rows x 12 tokens fit, 4 x 9 do not
    assert logical_micro_batches(lengths, None, None, 2) == 2  # at least the largest size the run may have
    assert logical_micro_batches(lengths, None, 1, 1) == 16  # one row each: the smallest a block can be
    for ranks in (1, 2, 4):
        per_rank = [lengths[r * 16 // ranks : (r + 1) * 16 // ranks] for r in range(ranks)]
        plan = layout_invariant_plan(per_rank, 4, None, 2)
        assert plan == [[4] * (4 // ranks)] * ranks  # each rank a contiguous block of the same 4 micro-batches
    with pytest.raises(ValueError, match="do not divide"):
        layout_invariant_plan([lengths[:8], lengths[8:]], None, None, 1)  # 1 logical micro-batch, 2 ranks
    with pytest.raises(ValueError, match="equal logical micro-batches"):
        logical_micro_batches(lengths[:12], None, None, 8)


def test_a_tree_sum_is_the_same_whatever_the_blocks_a_left_fold_is_not() -> None:
    from rlrunner.backends.tree_sum import TreeSum, tree_combine

    leaves = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) * 10 ** (i % 5) for i in range(16)]

    def blocked(ranks: int) -> torch.Tensor:
        totals = []
        for rank in range(ranks):
            tree = TreeSum()
            for leaf in leaves[rank * 16 // ranks : (rank + 1) * 16 // ranks]:
                tree.push(leaf.clone())
            totals.append(tree.total())
        return tree_combine(totals)

    whole = blocked(1)
    for ranks in (2, 4, 8, 16):
        assert torch.equal(blocked(ranks), whole)
    folded = [sum(leaves[:8], torch.zeros(1000)) + sum(leaves[8:], torch.zeros(1000)), sum(leaves, torch.zeros(1000))]
    assert not torch.equal(folded[0], folded[1])  # the order matters for a plain sum
