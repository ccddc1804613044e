"""Advantage estimators, policy losses, loss aggregation, rollout correction and their registries, each checked
against its formula written out over plain Python floats (or against values worked out by hand)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from rlrunner.algorithms import advantages, aggregation, policy_losses, registry
from rlrunner.algorithms.advantages import grpo, reinforce_plus_plus_baseline, rloo
from rlrunner.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss
from rlrunner.algorithms.grpo import group_advantages, masked_sum
from rlrunner.algorithms.policy_losses import PolicyLossTerms, gspo, ppo_clip
from rlrunner.algorithms.rollout_correction import tis_weights
from rlrunner.errors import ConfigError

TOL = 1e-5


def close(actual: torch.Tensor, expected, tol: float = TOL) -> bool:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    return actual.shape == expected.shape and torch.allclose(actual, expected, atol=tol, rtol=0)


def groups_of(values: list[float], group_size: int) -> list[list[float]]:
    return [values[i : i + group_size] for i in range(0, len(values), group_size)]


REWARDS = [1.0, 0.0, 0.0, 0.0, 5.0, 1.0, 3.0, 3.0, 0.5, 0.5, 2.0, -1.0]
LENGTHS = [3, 1, 4, 2, 5, 2, 1, 6, 7, 3, 2, 4]


# --- advantage estimators -------------------------------------------------------


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_estimator_is_bit_identical_to_group_advantages(norm: bool) -> None:
    rewards = torch.rand(24, generator=torch.Generator().manual_seed(1))
    lengths = torch.randint(1, 50, (24,), generator=torch.Generator().manual_seed(2))
    assert torch.equal(grpo(rewards, 4, lengths, norm), group_advantages(rewards, 4, norm))
    # the hand value of the first group [1,0,0,0]: [1.5,-0.5,-0.5,-0.5] normalised, [0.75,-0.25,...] centred
    adv = grpo(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, torch.ones(4, dtype=torch.long), norm)
    assert close(adv, [1.5, -0.5, -0.5, -0.5] if norm else [0.75, -0.25, -0.25, -0.25])


def rloo_by_hand(rewards: list[float], group_size: int) -> list[float]:
    out = []
    for group in groups_of(rewards, group_size):
        for i, r in enumerate(group):
            others = [x for j, x in enumerate(group) if j != i]
            out.append(r - sum(others) / len(others))
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_rloo_is_reward_minus_mean_of_the_others(norm: bool) -> None:
    adv = rloo(torch.tensor(REWARDS), 4, torch.tensor(LENGTHS), norm)
    assert adv.dtype == torch.float32
    assert close(adv, rloo_by_hand(REWARDS, 4))
    # hand values, group [1,0,0,0]: 1 - 0 = 1; 0 - 1/3 = -1/3
    assert close(adv[:4], [1.0, -1 / 3, -1 / 3, -1 / 3])


def test_rloo_pair_and_integer_rewards() -> None:
    # [2,4]: 2 - 4 = -2, 4 - 2 = 2 (twice the centred reward, G/(G-1) = 2)
    adv = rloo(torch.tensor([2, 4]), 2, torch.ones(2, dtype=torch.long), False)
    assert adv.dtype == torch.float32
    assert close(adv, [-2.0, 2.0])


@pytest.mark.parametrize(
    ("rewards", "group_size", "match"),
    [
        (torch.zeros(4), 1, "group_size >= 2"),
        (torch.zeros(5), 4, "group_size=4"),
        (torch.zeros(2, 4), 4, "group_size=4"),
        (torch.zeros(4), 0, "group_size=0"),
    ],
)
def test_rloo_bad_input_raises(rewards: torch.Tensor, group_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        rloo(rewards, group_size, torch.ones(rewards.shape[-1], dtype=torch.long), False)


def rpp_by_hand(rewards: list[float], group_size: int, lengths: list[int]) -> list[float]:
    centred = []
    for group in groups_of(rewards, group_size):
        mean = sum(group) / len(group)
        centred += [r - mean for r in group]
    tokens = sum(lengths)
    mean_w = sum(n * a for n, a in zip(lengths, centred)) / tokens
    var = sum(n * (a - mean_w) ** 2 for n, a in zip(lengths, centred)) / (tokens - 1)
    return [(a - mean_w) / math.sqrt(var + 1e-8) for a in centred]


@pytest.mark.parametrize("norm", [True, False])
def test_reinforce_plus_plus_baseline_matches_token_weighted_whitening(norm: bool) -> None:
    adv = reinforce_plus_plus_baseline(torch.tensor(REWARDS), 4, torch.tensor(LENGTHS), norm)
    assert adv.dtype == torch.float32
    assert close(adv, rpp_by_hand(REWARDS, 4, LENGTHS))


def test_reinforce_plus_plus_baseline_hand_value_weights_by_length() -> None:
    # [1,0], lengths [1,3]: a = [0.5,-0.5]; mean_w = (0.5 - 1.5)/4 = -0.25
    # var = (1 * 0.75^2 + 3 * 0.25^2) / (4 - 1) = 0.75/3 = 0.25 -> std 0.5; A = [0.75, -0.25] / 0.5 = [1.5, -0.5]
    adv = reinforce_plus_plus_baseline(torch.tensor([1.0, 0.0]), 2, torch.tensor([1, 3]), True)
    assert close(adv, [1.5, -0.5])
    # equal lengths would whiten to [0.70711, -0.70711] instead
    equal = reinforce_plus_plus_baseline(torch.tensor([1.0, 0.0]), 2, torch.tensor([2, 2]), True)
    assert close(equal, rpp_by_hand([1.0, 0.0], 2, [2, 2]))
    assert not close(equal, [1.5, -0.5])


def test_reinforce_plus_plus_baseline_without_tokens_is_finite() -> None:
    adv = reinforce_plus_plus_baseline(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2, torch.zeros(4, dtype=torch.long), True)
    assert torch.isfinite(adv).all()


@pytest.mark.parametrize(
    ("rewards", "lengths", "match"),
    [
        (torch.zeros(5), torch.ones(5, dtype=torch.long), "group_size=4"),
        (torch.zeros(4), torch.ones(3, dtype=torch.long), "response_lengths"),
        (torch.zeros(4), torch.ones(4, 1, dtype=torch.long), "response_lengths"),
    ],
)
def test_reinforce_plus_plus_baseline_bad_shapes_raise(
    rewards: torch.Tensor, lengths: torch.Tensor, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        reinforce_plus_plus_baseline(rewards, 4, lengths, True)


# --- ppo_clip -------------------------------------------------------------------------


def old_clipped_policy_loss(log_probs, old_log_probs, advantages, clip_low, clip_high):
    """The clipped loss as grpo.py computed it before it moved to policy_losses.ppo_clip."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float(), -log_ratio.detach()


@pytest.mark.parametrize("per_token_adv", [False, True])
def test_ppo_clip_is_bit_identical_to_the_old_clipped_loss(per_token_adv: bool) -> None:
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(6, 9, generator=g) * 3
    new = (old + torch.randn(6, 9, generator=g) * 0.4).requires_grad_(True)
    new_ref = new.detach().clone().requires_grad_(True)
    adv = torch.randn(6, 9, generator=g) if per_token_adv else torch.randn(6, generator=g)
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    terms = ppo_clip(new, old, adv, mask, 0.2, 0.28)
    loss, clipped, approx_kl = old_clipped_policy_loss(new_ref, old, adv, 0.2, 0.28)
    assert torch.equal(terms.loss, loss)
    assert torch.equal(terms.clipped, clipped)
    assert torch.equal(terms.approx_kl, approx_kl)
    assert 0 < clipped.sum() < clipped.numel()  # both branches are exercised
    (terms.loss * mask).sum().backward()
    (loss * mask).sum().backward()
    assert torch.equal(new.grad, new_ref.grad)


def test_ppo_clip_ignores_mask() -> None:
    lp = torch.log(torch.tensor([[1.5, 1.1, 0.5]]))
    a = ppo_clip(lp, torch.zeros(1, 3), torch.tensor([2.0]), torch.ones(1, 3), 0.2, 0.2)
    b = ppo_clip(lp, torch.zeros(1, 3), torch.tensor([2.0]), torch.tensor([[0.0, 1.0, 0.0]]), 0.2, 0.2)
    assert torch.equal(a.loss, b.loss)
    assert close(a.loss, [[-2.4, -2.2, -1.0]])


# --- gspo ---------------------------------------------------------------------------


def gspo_by_hand(log_probs, old, adv, mask, clip_low, clip_high):
    """(loss, clipped) per token as nested lists, from the sequence ratio exp(masked mean log ratio)."""
    losses, clips = [], []
    for lp_row, old_row, a, m_row in zip(log_probs, old, adv, mask):
        kept = [lp - o for lp, o, m in zip(lp_row, old_row, m_row) if m]
        s = sum(kept) / len(kept) if kept else 0.0
        r = math.exp(min(s, 10.0))
        unclipped, clipped = -a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high)
        losses.append([max(unclipped, clipped)] * len(lp_row))
        clips.append([1.0 if clipped > unclipped else 0.0] * len(lp_row))
    return losses, clips


GSPO_OLD = [[-1.0, -2.0, -0.5, -3.0], [-0.2, -1.2, -2.2, -0.7], [-1.5, -0.1, -4.0, -2.0], [-1.0, -1.0, -1.0, -1.0]]
GSPO_NEW = [[-0.9, -2.1, -0.45, -9.0], [0.3, -0.5, -2.2, -0.7], [-1.9, -0.6, -4.3, -1.0], [-1.0, -1.0, -1.0, -1.0]]
GSPO_MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
# row 0: log ratios [0.1,-0.1,0.05] (the masked -6 does not count) -> s = 0.05/3, inside the band
# row 1: s = (0.5+0.7+0+0)/4 = 0.3 -> r = 1.35 with A = 2: clipped at 1.2
# row 2: s = (-0.4-0.5-0.3)/3 = -0.4 -> r = 0.67 with A = -1: clipped at 0.8
# row 3: no response tokens -> s = 0, r = 1
GSPO_ADV = [1.5, 2.0, -1.0, 0.7]


def test_gspo_value_is_the_clipped_sequence_ratio() -> None:
    terms = gspo(
        torch.tensor(GSPO_NEW), torch.tensor(GSPO_OLD), torch.tensor(GSPO_ADV), torch.tensor(GSPO_MASK), 0.2, 0.2
    )
    loss, clipped = gspo_by_hand(GSPO_NEW, GSPO_OLD, GSPO_ADV, GSPO_MASK, 0.2, 0.2)
    assert close(terms.loss, loss)
    assert torch.equal(terms.clipped, torch.tensor(clipped))
    assert close(terms.loss[:, 0], [-1.5 * math.exp(0.05 / 3), -2.4, 0.8, -0.7])
    assert terms.clipped[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0]


def test_gspo_asymmetric_clip_band() -> None:
    # clip_high 0.4: row 1's r = exp(0.3) = 1.34986 now lies inside the band; row 2 is still clipped at 1 - 0.2
    terms = gspo(
        torch.tensor(GSPO_NEW), torch.tensor(GSPO_OLD), torch.tensor(GSPO_ADV), torch.tensor(GSPO_MASK), 0.2, 0.4
    )
    loss, clipped = gspo_by_hand(GSPO_NEW, GSPO_OLD, GSPO_ADV, GSPO_MASK, 0.2, 0.4)
    assert close(terms.loss, loss)
    assert terms.loss[1, 0].item() == pytest.approx(-2.0 * math.exp(0.3), abs=TOL)
    assert terms.clipped[:, 0].tolist() == [0.0, 0.0, 1.0, 0.0]


def test_gspo_gradient_is_the_sequence_ratio_times_each_tokens_own() -> None:
    # unclipped (wide band): d(sum_t mask * -A exp(s_i)) / d lp_t = -A_i exp(s_i) mask_t; s_i passes no gradient
    lp = torch.tensor(GSPO_NEW, requires_grad=True)
    mask = torch.tensor(GSPO_MASK)
    terms = gspo(lp, torch.tensor(GSPO_OLD), torch.tensor(GSPO_ADV), mask, 0.9, 10.0)
    assert terms.clipped.sum().item() == 0.0
    (terms.loss * mask).sum().backward()
    expected = []
    for lp_row, old_row, a, m_row in zip(GSPO_NEW, GSPO_OLD, GSPO_ADV, GSPO_MASK):
        kept = [x - o for x, o, m in zip(lp_row, old_row, m_row) if m]
        s = sum(kept) / len(kept) if kept else 0.0
        expected.append([-a * math.exp(s) * m for m in m_row])
    assert close(lp.grad, expected)


def test_gspo_clamps_the_log_ratio_and_reports_token_approx_kl() -> None:
    new = torch.tensor([[50.0, 50.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    # A = -1, r = e^10 (capped from e^50): unclipped -A r = e^10 beats the clipped 1.2
    terms = gspo(new, old, torch.tensor([-1.0]), torch.ones(1, 2), 0.2, 0.2)
    assert close(terms.loss, [[math.exp(10.0), math.exp(10.0)]], tol=1e-1)
    assert torch.isfinite(terms.loss).all()
    assert close(terms.approx_kl, [[-50.0, -50.0]])
    assert not terms.approx_kl.requires_grad


def test_gspo_differs_from_ppo_clip_when_token_ratios_differ() -> None:
    lp = torch.log(torch.tensor([[1.5, 0.9]]))
    args = (torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), 0.2, 0.2)
    # per token: r = 1.5 -> clipped -1.2, r = 0.9 -> -0.9; GSPO: one ratio sqrt(1.35) = 1.16190 for both
    assert close(ppo_clip(lp, *args).loss, [[-1.2, -0.9]])
    assert close(gspo(lp, *args).loss, [[-math.sqrt(1.35), -math.sqrt(1.35)]])


# --- aggregate_loss -----------------------------------------------------------------


def aggregate_by_hand(per_token: list[list[float]], mask: list[list[float]], mode: str, max_len: int) -> float:
    row_sums = [sum(v * m for v, m in zip(vs, ms)) for vs, ms in zip(per_token, mask)]
    row_tokens = [sum(ms) for ms in mask]
    tokens = sum(row_tokens)
    sequences = sum(1 for n in row_tokens if n > 0)
    if mode == "token-mean":
        return sum(row_sums) / tokens
    if mode == "seq-mean-token-sum":
        return sum(row_sums) / sequences
    if mode == "seq-mean-token-mean":
        return sum(s / n for s, n in zip(row_sums, row_tokens) if n > 0) / sequences
    if mode == "seq-mean-token-sum-norm":
        return sum(row_sums) / (sequences * max_len)
    raise AssertionError(mode)


HAND_PER_TOKEN = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
HAND_MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
# kept: row 0 -> 1 + 2 = 3 over 2 tokens, row 1 -> 15 over 3 tokens, row 2 empty: 5 tokens, 2 sequences
HAND_EXPECTED = {
    "token-mean": 18 / 5,
    "seq-mean-token-sum": 18 / 2,
    "seq-mean-token-mean": (1.5 + 5.0) / 2,
    "seq-mean-token-sum-norm": 18 / (2 * 3),
}


def test_loss_agg_modes_are_the_documented_ones() -> None:
    assert LOSS_AGG_MODES == ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    assert set(HAND_EXPECTED) == set(LOSS_AGG_MODES)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("dp_size", [1, 2])
def test_aggregate_loss_hand_batch(mode: str, dp_size: int) -> None:
    loss = aggregate_loss(
        torch.tensor(HAND_PER_TOKEN),
        torch.tensor(HAND_MASK),
        mode,
        global_tokens=5.0,
        global_sequences=2.0,
        max_response_length=3,
        dp_size=dp_size,
    )
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(HAND_EXPECTED[mode] * dp_size, abs=TOL)
    assert loss.item() == pytest.approx(aggregate_by_hand(HAND_PER_TOKEN, HAND_MASK, mode, 3) * dp_size, abs=TOL)


def test_aggregate_token_mean_is_bit_identical_to_the_old_expression() -> None:
    g = torch.Generator().manual_seed(4)
    per_token = torch.randn(5, 11, generator=g)
    mask = (torch.rand(5, 11, generator=g) > 0.4).float()
    loss = aggregate_loss(
        per_token, mask, "token-mean", global_tokens=123.0, global_sequences=9.0, max_response_length=11, dp_size=4
    )
    assert torch.equal(loss, masked_sum(per_token, mask) * (4 / 123.0))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_over_ranks_and_micro_batches_equals_the_whole_batch(mode: str) -> None:
    g = torch.Generator().manual_seed(5)
    rows, width, max_len = 8, 6, 6
    per_token = torch.randn(rows, width, generator=g)
    lengths = [6, 2, 0, 4, 1, 5, 3, 6]  # row 2 has no response token: not a sequence for the seq-mean modes
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(width)] for n in lengths])
    expected = aggregate_by_hand(per_token.tolist(), mask.tolist(), mode, max_len)
    counts = {"global_tokens": float(sum(lengths)), "global_sequences": float(sum(n > 0 for n in lengths))}
    dp_size, rows_per_rank, rows_per_micro = 2, 4, 2
    rank_losses = []
    for rank in range(dp_size):
        total = torch.zeros(())
        for start in range(rank * rows_per_rank, (rank + 1) * rows_per_rank, rows_per_micro):
            index = slice(start, start + rows_per_micro)
            total = total + aggregate_loss(
                per_token[index], mask[index], mode, **counts, max_response_length=max_len, dp_size=dp_size
            )
        rank_losses.append(total)
    averaged = sum(rank_losses) / dp_size  # what averaging the gradients over the ranks amounts to
    assert averaged.item() == pytest.approx(expected, abs=TOL)


def test_aggregate_unknown_mode_raises_naming_it() -> None:
    with pytest.raises(ValueError, match="'seq-sum'"):
        aggregate_loss(
            torch.ones(1, 1),
            torch.ones(1, 1),
            "seq-sum",
            global_tokens=1.0,
            global_sequences=1.0,
            max_response_length=1,
            dp_size=1,
        )


# --- tis_weights ------------------------------------------------------------------------


def test_tis_weights_formula() -> None:
    old = [[0.0, -1.0, -2.0, -0.3], [-5.0, -0.7, -0.1, -3.0]]
    rollout = [[0.0, -2.0, -0.5, -0.3], [-4.0, -1.4, -2.0, -3.5]]
    cap = 2.0
    weights, capped = tis_weights(torch.tensor(old), torch.tensor(rollout), cap)
    ratios = [[math.exp(o - r) for o, r in zip(orow, rrow)] for orow, rrow in zip(old, rollout)]
    assert close(weights, [[min(x, cap) for x in row] for row in ratios])
    assert capped.tolist() == [[1.0 if x > cap else 0.0 for x in row] for row in ratios]
    # hand values of row 0: exp(0) = 1, exp(1) = e -> capped to 2, exp(-1.5) = 0.22313, exp(0) = 1
    assert close(weights[0], [1.0, 2.0, math.exp(-1.5), 1.0])
    assert capped[0].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_tis_weights_extreme_differences_stay_finite() -> None:
    old = torch.tensor([[0.0, -1e4, 100.0, 0.0, -float("inf")]])
    rollout = torch.tensor([[-1e4, 0.0, -100.0, -float("inf"), 0.0]])
    weights, capped = tis_weights(old, rollout, 5.0)
    assert torch.isfinite(weights).all()
    assert weights.tolist() == [[5.0, 0.0, 5.0, 5.0, 0.0]]
    assert capped.tolist() == [[1.0, 0.0, 1.0, 1.0, 0.0]]


def test_tis_weights_are_detached_float32() -> None:
    old = torch.tensor([[-0.5, -1.0]], dtype=torch.bfloat16, requires_grad=True)
    rollout = torch.tensor([[-1.0, -1.0]], dtype=torch.bfloat16)
    weights, capped = tis_weights(old, rollout, 2.0)
    assert weights.dtype == capped.dtype == torch.float32
    assert not weights.requires_grad
    assert close(weights, [[math.exp(0.5), 1.0]], tol=1e-2)


def test_tis_weights_non_positive_cap_raises() -> None:
    with pytest.raises(ValueError, match="cap"):
        tis_weights(torch.zeros(1, 1), torch.zeros(1, 1), 0.0)


# --- registries ----------------------------------------------------------------------


def test_registries_load_their_functions() -> None:
    assert registry.get_adv_estimator("grpo") is advantages.grpo
    assert registry.get_adv_estimator("rloo") is advantages.rloo
    assert registry.get_adv_estimator("reinforce_plus_plus_baseline") is advantages.reinforce_plus_plus_baseline
    assert registry.get_policy_loss("ppo_clip") is policy_losses.ppo_clip
    assert registry.get_policy_loss("gspo") is policy_losses.gspo
    assert aggregation.LOSS_AGG_MODES is registry.LOSS_AGG_MODES
    for mode in LOSS_AGG_MODES:
        registry.check_loss_agg_mode(mode)


@pytest.mark.parametrize("name", list(registry.ADV_ESTIMATORS))
def test_every_estimator_takes_the_common_signature(name: str) -> None:
    adv = registry.get_adv_estimator(name)(torch.tensor(REWARDS), 4, torch.tensor(LENGTHS), True)
    assert adv.shape == (12,) and adv.dtype == torch.float32
    assert adv.abs().sum() > 0


@pytest.mark.parametrize("name", list(registry.POLICY_LOSSES))
def test_every_policy_loss_takes_the_common_signature(name: str) -> None:
    terms = registry.get_policy_loss(name)(
        torch.tensor(GSPO_NEW), torch.tensor(GSPO_OLD), torch.tensor(GSPO_ADV), torch.tensor(GSPO_MASK), 0.2, 0.2
    )
    assert isinstance(terms, PolicyLossTerms)
    assert terms.loss.shape == terms.clipped.shape == terms.approx_kl.shape == (4, 4)


def test_registry_errors_name_the_key_and_the_choices() -> None:
    with pytest.raises(ConfigError) as err:
        registry.get_adv_estimator("gae")
    assert str(err.value) == (
        "algorithm.adv_estimator must be one of grpo, rloo, reinforce_plus_plus_baseline, got 'gae'"
    )
    with pytest.raises(ConfigError) as err:
        registry.get_policy_loss("dapo")
    assert str(err.value) == "algorithm.policy_loss must be one of ppo_clip, gspo, got 'dapo'"
    with pytest.raises(ConfigError) as err:
        registry.check_loss_agg_mode("mean")
    assert str(err.value) == (
        "algorithm.loss_agg_mode must be one of token-mean, seq-mean-token-sum, seq-mean-token-mean, "
        "seq-mean-token-sum-norm, got 'mean'"
    )


def test_registry_imports_no_torch() -> None:
    code = "import rlrunner.algorithms.registry, sys; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
