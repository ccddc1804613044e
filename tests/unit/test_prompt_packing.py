"""Rows packed by prompt give the unpacked rows' logits, each response seeing its prompt and itself only; the packer
packs where its estimate saves work (rlrunner.backends.prompt_packing)."""

import pytest
import torch

from rlrunner.backends.prompt_packing import ForwardCost, PromptPacker, pack_shared_prompts, prompt_groups
from rlrunner.models.loading import build_model
from rlrunner.models.tokenizer import build_char_tokenizer

from conftest import TINY_MODEL_CFG as TINY

PAD = 0


def rows(samples: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, list[int], list[int]]:
    """Right-padded (prompt + response) rows, their prompt lengths and lengths, as the driver's batch holds them."""
    lengths = [len(p) + len(r) for p, r in samples]
    width = max(lengths)
    ids = torch.tensor([p + r + [PAD] * (width - len(p) - len(r)) for p, r in samples])
    return ids, [len(p) for p, _ in samples], lengths


# two prompts of different lengths, their rows interleaved (a group need not be contiguous), responses of different
# lengths (one of a single token), and a row whose prompt no other row has
SAMPLES = [
    ([10, 11, 12, 13], [20, 21, 22, 1]),
    ([30, 31], [40, 41, 42, 43, 44]),
    ([10, 11, 12, 13], [23, 1]),
    ([30, 31], [45]),
    ([10, 11, 12, 13], [24, 25, 26, 27]),
    ([50, 51, 52], [60, 61]),
    ([30, 31], [46, 47, 48]),
]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(TINY, build_char_tokenizer(), seed=0).eval()


def packed_logits(model: torch.nn.Module, samples: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unpacked logits [rows, width - 1, vocab], packed ones gathered back, the target positions that count)."""
    ids, prompts, lengths = rows(samples)
    packed = pack_shared_prompts(ids, prompts, lengths, prompt_groups(ids, prompts))
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits[:, :-1]
        out = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            attention_mask=packed.attention_mask,
            use_cache=False,
        ).logits
    position = torch.arange(ids.shape[1] - 1)
    real = position[None] < torch.tensor(lengths)[:, None] - 1  # every position whose target is a real token
    return plain, packed.gather(out), real


def test_packed_rows_give_the_unpacked_logits(model: torch.nn.Module) -> None:
    ids, prompts, _ = rows(SAMPLES)
    assert prompt_groups(ids, prompts) == [[0, 2, 4], [1, 3, 6], [5]]
    plain, packed, real = packed_logits(model, SAMPLES)
    assert packed.shape == plain.shape
    assert torch.allclose(packed[real], plain[real], atol=1e-5), (packed[real] - plain[real]).abs().max()
    # a padding target reads its row's last token (finite, masked out of every loss)
    assert torch.isfinite(packed).all()


def test_a_response_sees_its_prompt_and_itself_only(model: torch.nn.Module) -> None:
    changed = list(SAMPLES)
    changed[2] = ([10, 11, 12, 13], [70, 71])  # another response of the first prompt
    _, before, real = packed_logits(model, SAMPLES)
    _, after, _ = packed_logits(model, changed)
    others = [0, 1, 3, 4, 5, 6]
    assert torch.equal(after[others][real[others]], before[others][real[others]])
    first_response = 3  # the prompt's last position predicts row 2's first response token: the same logits
    assert torch.equal(after[2, first_response], before[2, first_response])
    assert not torch.allclose(after[2, first_response + 1], before[2, first_response + 1])


def test_the_packed_layout() -> None:
    ids, prompts, lengths = rows(SAMPLES[:4])
    packed = pack_shared_prompts(ids, prompts, lengths, prompt_groups(ids, prompts))
    # the prompt but its last token, then each row's copy of that token and its response, positions continuing the
    # prompt's; the shorter sequence padded
    assert packed.input_ids.tolist() == [
        [10, 11, 12, 13, 20, 21, 22, 1, 13, 23, 1],
        [30, 31, 40, 41, 42, 43, 44, 31, 45, 0, 0],
    ]
    assert packed.position_ids.tolist() == [
        [0, 1, 2, 3, 4, 5, 6, 7, 3, 4, 5],
        [0, 1, 2, 3, 4, 5, 6, 1, 2, 0, 0],
    ]
    mask = packed.attention_mask[0, 0]
    assert mask[8].tolist() == [True] * 3 + [False] * 5 + [True, False, False]  # row 2's copy: the prompt, itself
    assert mask[:3, :3].equal(torch.ones(3, 3, dtype=torch.bool).tril())
    assert packed.attention_mask[1, 0, 10].tolist() == [False] * 10 + [True]  # padding sees itself only
    # row 3 (one response token): the prompt's first position, its copy of the last (which predicts its token, the
    # only position a loss reads), then its token for every padding target
    assert packed.source_rows[3].tolist() == [1] * 7
    assert packed.source_columns[3].tolist() == [0, 7, 8, 8, 8, 8, 8]
    # every position a loss reads (from the prompt's last token to the row's last but one) is a row's own
    read = [
        (int(packed.source_rows[r, j]), int(packed.source_columns[r, j]))
        for r in range(4)
        for j in range(prompts[r] - 1, lengths[r] - 1)
    ]
    assert len(read) == len(set(read)) == sum(lengths) - sum(prompts)


def test_the_packer_packs_where_it_saves() -> None:
    cost = ForwardCost.from_config(_config(hidden=128, heads=4, kv=2, ffn=256))
    group = [([10, 11, 12, 13], [20 + i, 21, 22, 1]) for i in range(16)]
    ids, prompts, lengths = rows(group)
    assert PromptPacker(None, cost).pack(ids, prompts, lengths) is not None  # the default job's shape
    assert PromptPacker(False, cost).pack(ids, prompts, lengths) is None
    long_responses = [([10, 11, 12, 13], [20 + i] * 400) for i in range(16)]  # attention over 6,404 tokens per pass
    ids, prompts, lengths = rows(long_responses)
    assert PromptPacker(None, cost).pack(ids, prompts, lengths) is None
    assert PromptPacker(True, cost).pack(ids, prompts, lengths) is not None
    distinct = [([10 + i, 11], [20, 1]) for i in range(4)]
    assert PromptPacker(True, cost).pack(*rows(distinct)) is None  # nothing to share


def _config(hidden: int, heads: int, kv: int, ffn: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=ffn, vocab_size=99
    )


def test_forward_cost_counts_the_layer() -> None:
    cost = ForwardCost.from_config(_config(hidden=128, heads=4, kv=2, ffn=256))
    # q and o 128x128, k and v 128x64, gate/up/down 128x256: 2 flops per weight; scores and values 4 x 128 per pair
    assert cost.per_token == 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256)
    assert cost.per_pair == 4 * 128
    assert cost.unpacked(2, 8) == 2 * (8 * cost.per_token + 36 * cost.per_pair)
    assert cost.packed(1, 12) == 12 * cost.per_token + 144 * cost.per_pair


def test_a_prompt_drawn_twice_is_cut_into_runs_of_the_median_group() -> None:
    twice = [([10, 11], [20 + i]) for i in range(8)] + [([30, 31], [40 + i]) for i in range(4)]
    ids, prompts, _ = rows(twice)
    assert prompt_groups(ids, prompts) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
