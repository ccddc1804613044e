"""GRPO tensor math checked against values worked out by hand."""

import math

import pytest
import torch

from rlrunner.algorithms.grpo import (
    group_advantages,
    kl_penalty,
    masked_mean,
    masked_sum,
    token_entropy,
    token_log_probs,
)
from rlrunner.algorithms.policy_losses import PolicyLossTerms, ppo_clip

TOL = 1e-5


def close(actual: torch.Tensor, expected, tol: float = TOL) -> bool:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    return actual.shape == expected.shape and torch.allclose(actual, expected, atol=tol, rtol=0)


# --- group_advantages -------------------------------------------------------


def test_group_advantages_one_group_normalised_by_std() -> None:
    # rewards [1,0,0,0]: mean 0.25, deviations [0.75,-0.25,-0.25,-0.25]
    # unbiased var = (0.5625 + 3*0.0625) / 3 = 0.25 -> std 0.5
    # advantages = deviations / 0.5 = [1.5,-0.5,-0.5,-0.5]  (eps 1e-6 moves them by < 1e-5)
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4)
    assert close(adv, [1.5, -0.5, -0.5, -0.5])


def test_group_advantages_without_std_normalisation() -> None:
    # only centred: [1,0,0,0] - 0.25
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, norm_by_std=False)
    assert close(adv, [0.75, -0.25, -0.25, -0.25])


def test_group_advantages_pair_uses_unbiased_std() -> None:
    # [2,4]: mean 3, deviations [-1,1], unbiased var = (1+1)/(2-1) = 2 -> std sqrt(2)
    # advantages = [-1/sqrt(2), 1/sqrt(2)] = [-0.70711, 0.70711] (the biased std 1 would give [-1, 1])
    adv = group_advantages(torch.tensor([2.0, 4.0]), group_size=2)
    s = 1 / math.sqrt(2)
    assert close(adv, [-s, s])


def test_group_advantages_several_groups_are_independent() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 5.0, 1.0, 3.0, 3.0])
    # group 0: [1,0,0,0] -> [1.5,-0.5,-0.5,-0.5] (see above)
    # group 1: [0,1,1,1]: mean 0.75, deviations [-0.75,0.25,0.25,0.25], std 0.5 -> [-1.5,0.5,0.5,0.5]
    # group 2: all equal -> zeros
    # group 3: [5,1,3,3]: mean 3, deviations [2,-2,0,0], unbiased var 8/3 -> std 1.63299
    #          -> [1.22474,-1.22474,0,0]
    g3 = 2 / math.sqrt(8 / 3)
    adv = group_advantages(rewards, group_size=4)
    expected = [1.5, -0.5, -0.5, -0.5, -1.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, g3, -g3, 0.0, 0.0]
    assert close(adv, expected)
    centred = group_advantages(rewards, group_size=4, norm_by_std=False)
    assert close(centred, [0.75, -0.25, -0.25, -0.25, -0.75, 0.25, 0.25, 0.25, 0, 0, 0, 0, 2, -2, 0, 0])


def test_group_advantages_all_equal_group_gives_exact_zeros() -> None:
    adv = group_advantages(torch.tensor([3.0, 3.0, 3.0, 3.0]), group_size=4)
    assert torch.equal(adv, torch.zeros(4))
    assert not torch.isnan(adv).any()


def test_group_advantages_returns_float_1d_for_integer_rewards() -> None:
    adv = group_advantages(torch.tensor([1, 0]), group_size=2, norm_by_std=False)
    assert adv.dtype == torch.float32
    assert close(adv, [0.5, -0.5])


@pytest.mark.parametrize(
    ("rewards", "group_size"),
    [
        (torch.zeros(2, 4), 4),  # not 1-D
        (torch.zeros(5), 4),  # not a multiple of group_size
        (torch.zeros(()), 1),  # 0-D
    ],
)
def test_group_advantages_bad_shape_raises(rewards: torch.Tensor, group_size: int) -> None:
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(rewards, group_size)


# --- token_log_probs / token_entropy ----------------------------------------


def test_token_log_probs_exact_hand_value() -> None:
    # logits [0, ln 3]: softmax = [1/4, 3/4]
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    lp = token_log_probs(logits, torch.tensor([[1, 0]]))
    assert close(lp, [[math.log(0.75), math.log(0.25)]])


def test_token_log_probs_matches_log_softmax_gather() -> None:
    logits = torch.tensor(
        [
            [[1.0, 2.0, 3.0, -1.0], [0.5, 0.5, -2.0, 4.0], [10.0, -10.0, 0.0, 1.0]],
            [[-3.0, 0.0, 0.0, 2.0], [7.0, 7.5, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
        ]
    )
    targets = torch.tensor([[2, 3, 1], [0, 1, 3]])
    expected = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    lp = token_log_probs(logits, targets)
    assert lp.shape == (2, 3)
    assert torch.allclose(lp, expected, atol=1e-6)
    # spot value: row 1 pos 2 is uniform over 4 -> ln(1/4)
    assert lp[1, 2].item() == pytest.approx(math.log(0.25), abs=1e-6)


def test_token_log_probs_is_float32_for_half_logits() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)]]], dtype=torch.bfloat16)
    lp = token_log_probs(logits, torch.tensor([[1]]))
    assert lp.dtype == torch.float32
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-2)


def test_token_entropy_uniform_is_log_vocab() -> None:
    logits = torch.zeros(2, 3, 7)
    ent = token_entropy(logits)
    assert ent.shape == (2, 3)
    assert torch.allclose(ent, torch.full((2, 3), math.log(7.0)), atol=1e-6)


def test_token_entropy_one_hot_is_zero_and_hand_value() -> None:
    peaked = torch.tensor([[[100.0, 0.0, 0.0, 0.0]]])
    assert token_entropy(peaked).item() == pytest.approx(0.0, abs=1e-6)
    # p = [1/4, 3/4]: H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    two = torch.tensor([[[0.0, math.log(3.0)]]])
    assert token_entropy(two).item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)


# --- ppo_clip (the clipped surrogate) -------------------------------------------


def _loss(ratio: float, advantage: float, clip_low: float = 0.2, clip_high: float = 0.2) -> PolicyLossTerms:
    log_probs = torch.tensor([[math.log(ratio)]])
    old = torch.zeros(1, 1)
    return ppo_clip(log_probs, old, torch.tensor([advantage]), torch.ones(1, 1), clip_low, clip_high)


def test_clipped_loss_positive_advantage_ratio_above_band_is_clipped() -> None:
    # A=2, r=1.5: unclipped -A r = -3.0; clipped -A (1+0.2) = -2.4; max = -2.4 (clipped branch)
    terms = _loss(1.5, 2.0)
    assert terms.loss.item() == pytest.approx(-2.4, abs=TOL)
    assert terms.clipped.item() == 1.0


def test_clipped_loss_ratio_inside_band_is_unclipped() -> None:
    # A=2, r=1.1: both branches -2.2 -> loss -2.2, not counted as clipped
    terms = _loss(1.1, 2.0)
    assert terms.loss.item() == pytest.approx(-2.2, abs=TOL)
    assert terms.clipped.item() == 0.0


def test_clipped_loss_positive_advantage_ratio_below_band_is_unclipped() -> None:
    # A=2, r=0.5: unclipped -1.0, clipped -2*0.8 = -1.6; max = -1.0 (unclipped, pessimistic bound)
    terms = _loss(0.5, 2.0)
    assert terms.loss.item() == pytest.approx(-1.0, abs=TOL)
    assert terms.clipped.item() == 0.0


def test_clipped_loss_negative_advantage_ratio_below_band_is_clipped() -> None:
    # A=-1, r=0.5: unclipped 0.5, clipped -A (1-0.2) = 0.8; max = 0.8 (clipped)
    terms = _loss(0.5, -1.0)
    assert terms.loss.item() == pytest.approx(0.8, abs=TOL)
    assert terms.clipped.item() == 1.0


def test_clipped_loss_negative_advantage_ratio_above_band_is_unclipped() -> None:
    # A=-1, r=1.5: unclipped -A r = 1.5, clipped 1.2; max = 1.5 (unclipped)
    terms = _loss(1.5, -1.0)
    assert terms.loss.item() == pytest.approx(1.5, abs=TOL)
    assert terms.clipped.item() == 0.0


def test_clipped_loss_asymmetric_clip() -> None:
    # clip_low 0.2, clip_high 0.28
    # A=1, r=1.5: clipped -1.28 > unclipped -1.5 -> -1.28
    up = _loss(1.5, 1.0, clip_low=0.2, clip_high=0.28)
    assert up.loss.item() == pytest.approx(-1.28, abs=TOL)
    assert up.clipped.item() == 1.0
    # A=-1, r=0.5: clipped 1*(1-0.2) = 0.8 > 0.5 -> 0.8
    down = _loss(0.5, -1.0, clip_low=0.2, clip_high=0.28)
    assert down.loss.item() == pytest.approx(0.8, abs=TOL)
    assert down.clipped.item() == 1.0
    # A=1, r=1.25 lies inside [0.8, 1.28]: unclipped -1.25 (with symmetric 0.2 it would be clipped to -1.2)
    inside = _loss(1.25, 1.0, clip_low=0.2, clip_high=0.28)
    assert inside.loss.item() == pytest.approx(-1.25, abs=TOL)
    assert inside.clipped.item() == 0.0
    # A=-1, r=0.75 lies below 1-clip_low=0.8 even though clip_high is wider: clipped to 0.8
    low = _loss(0.75, -1.0, clip_low=0.2, clip_high=0.28)
    assert low.loss.item() == pytest.approx(0.8, abs=TOL)


def test_clipped_loss_broadcast_of_sequence_advantages() -> None:
    ratios = torch.tensor([[1.5, 1.1, 0.5], [0.5, 1.5, 1.0]])
    log_probs = torch.log(ratios)
    old = torch.zeros(2, 3)
    adv_b = torch.tensor([2.0, -1.0])
    per_seq = ppo_clip(log_probs, old, adv_b, torch.ones(2, 3), 0.2, 0.2)
    per_tok = ppo_clip(log_probs, old, adv_b.unsqueeze(-1).expand(2, 3), torch.ones(2, 3), 0.2, 0.2)
    assert per_seq.loss.shape == (2, 3)
    assert torch.allclose(per_seq.loss, per_tok.loss)
    assert torch.equal(per_seq.clipped, per_tok.clipped)
    # row 0 (A=2): r 1.5 -> -2.4 (clipped), 1.1 -> -2.2, 0.5 -> -1.0
    # row 1 (A=-1): r 0.5 -> 0.8 (clipped), 1.5 -> 1.5, 1.0 -> 1.0
    assert close(per_seq.loss, [[-2.4, -2.2, -1.0], [0.8, 1.5, 1.0]])
    assert torch.equal(per_seq.clipped, torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))


def test_clipped_loss_per_token_advantages_differ_per_position() -> None:
    log_probs = torch.log(torch.tensor([[1.5, 1.5]]))
    adv = torch.tensor([[2.0, -1.0]])
    terms = ppo_clip(log_probs, torch.zeros(1, 2), adv, torch.ones(1, 2), 0.2, 0.2)
    # pos 0: A=2, r=1.5 -> -2.4 clipped; pos 1: A=-1, r=1.5 -> 1.5 unclipped
    assert close(terms.loss, [[-2.4, 1.5]])
    assert torch.equal(terms.clipped, torch.tensor([[1.0, 0.0]]))


def test_clipped_loss_gradient_is_zero_on_clipped_tokens() -> None:
    # tokens: (A=2, r=1.5) clipped; (A=2, r=1.1) unclipped: d(-A r)/d log p = -A r = -2.2
    log_probs = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_(True)
    terms = ppo_clip(log_probs, torch.zeros(1, 2), torch.tensor([2.0]), torch.ones(1, 2), 0.2, 0.2)
    terms.loss.sum().backward()
    assert log_probs.grad[0, 0].item() == 0.0
    assert log_probs.grad[0, 1].item() == pytest.approx(-2.2, abs=TOL)


def test_approx_kl_is_old_minus_new_and_detached() -> None:
    log_probs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.0, -0.5]])
    terms = ppo_clip(log_probs, old, torch.tensor([1.0]), torch.ones(1, 3), 0.2, 0.2)
    assert close(terms.approx_kl, [[-0.5, 1.0, 0.0]])
    assert not terms.approx_kl.requires_grad


# --- kl_penalty ---------------------------------------------------------------


def test_kl_penalty_zero_when_equal() -> None:
    lp = torch.tensor([[-0.3, -2.0, -7.5]])
    assert torch.equal(kl_penalty(lp, lp.clone()), torch.zeros(1, 3))


def test_kl_penalty_hand_values() -> None:
    # d = ref - lp
    # d = ln 2:  e^d - d - 1 = 2 - ln 2 - 1 = 0.306853
    # d = -ln 2: 0.5 + ln 2 - 1 = 0.193147
    lp = torch.tensor([0.0, math.log(2.0)])
    ref = torch.tensor([math.log(2.0), 0.0])
    assert close(kl_penalty(lp, ref), [1 - math.log(2.0), math.log(2.0) - 0.5])


def test_kl_penalty_non_negative_and_finite() -> None:
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(64, 16, generator=g) * 10
    ref = -torch.rand(64, 16, generator=g) * 10
    kl = kl_penalty(lp, ref)
    assert (kl >= 0).all()
    assert (kl > 0).any()
    extreme = kl_penalty(torch.tensor([-100.0, 0.0]), torch.tensor([0.0, -100.0]))
    assert torch.isfinite(extreme).all()
    # deltas are clamped to +-20: e^20 - 20 - 1 and e^-20 + 20 - 1
    assert extreme[0].item() == pytest.approx(math.exp(20) - 21, rel=1e-5)
    assert extreme[1].item() == pytest.approx(19.0, abs=1e-4)


# --- masked reductions ----------------------------------------------------------


def test_masked_sum_and_mean() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    # kept: 1 + 3 + 5 = 9 over 3 tokens
    assert masked_sum(values, mask).item() == 9.0
    assert masked_mean(values, mask).item() == 3.0


def test_masked_mean_all_zero_mask_is_zero_not_nan() -> None:
    values = torch.tensor([[1.0, -2.0], [2.0, 3.0]])
    mask = torch.zeros(2, 2)
    mean = masked_mean(values, mask)
    assert not torch.isnan(mean)
    assert mean.item() == 0.0
    assert masked_sum(values, mask).item() == 0.0
