"""An elastic run's group sizes (rlrunner.runner.elastic): the sizes allowed, the one an attempt takes, growing back."""

from __future__ import annotations

import pytest

from rlrunner.config import load_config
from rlrunner.errors import ConfigError
from rlrunner.runner.elastic import ElasticSizes, Layout, choose_layout, layout_invariant

from conftest import TINY_MODEL


def _cfg(*overrides: str):
    return load_config([*TINY_MODEL, "data.batch_size=4", "algorithm.group_size=4", *overrides])


def test_the_sizes_an_elastic_run_may_take():
    cfg = _cfg("actor.num_workers=4", "rollout.num_workers=2")
    assert layout_invariant(cfg, supported=True)  # elastic and above the minimum: on
    sizes = ElasticSizes.of(cfg, rows_per_minibatch=16, invariant=True)
    assert sizes.configured == Layout(4, 2)
    assert sizes.actor_sizes == (4, 2, 1) and sizes.rollout_sizes == (2, 1)  # powers of two only: no 3
    stock = ElasticSizes.of(_cfg("actor.num_workers=4", "actor.micro_batch_size=2"), 16, invariant=False)
    assert stock.actor_sizes == (4, 2, 1)  # 3 does not divide 16 rows
    assert ElasticSizes.of(_cfg("actor.num_workers=4", "cluster.min_actor_ranks=2"), 16, True).actor_sizes == (4, 2)
    fixed = _cfg("actor.num_workers=4", "runner.recovery.elastic=false")
    assert not layout_invariant(fixed, supported=True) and not layout_invariant(cfg, supported=False)
    assert ElasticSizes.of(fixed, 16, False).candidates() == [Layout(4, 1)]
    assert not layout_invariant(_cfg("actor.num_workers=1"), supported=True)  # cannot shrink: nothing to keep


def test_an_attempt_takes_the_configured_sizes_else_after_the_wait_the_largest_that_fit():
    sizes = ElasticSizes(Layout(4, 2), (4, 2, 1), (2, 1))
    asked: list[Layout] = []

    def fits(limit: Layout):
        def check(layout: Layout) -> bool:
            asked.append(layout)
            return layout.actor_ranks <= limit.actor_ranks and layout.rollout_workers <= limit.rollout_workers

        return check

    assert choose_layout(sizes, fits(Layout(4, 2)), 10.0, lambda: False) == Layout(4, 2)
    assert choose_layout(sizes, fits(Layout(3, 1)), 0.0, lambda: False) == Layout(2, 1)
    assert choose_layout(sizes, fits(Layout(4, 1)), 0.0, lambda: False) == Layout(4, 1)  # a rollout worker less
    asked.clear()
    assert choose_layout(sizes, fits(Layout(0, 2)), 0.05, lambda: False, poll_s=0.01) is None  # below the minimum
    assert asked.count(Layout(4, 2)) >= 2  # it waited for the configured sizes first


def test_a_shrunk_run_grows_to_the_largest_layout_the_cluster_fits_again():
    sizes = ElasticSizes(Layout(4, 2), (4, 2, 1), (2, 1))
    assert sizes.grow_target(Layout(1, 1), lambda layout: layout.actor_ranks <= 2) == Layout(2, 2)
    assert sizes.grow_target(Layout(2, 2), lambda layout: layout.actor_ranks <= 2) is None
    assert sizes.grow_target(Layout(4, 1), lambda layout: True) == Layout(4, 2)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["actor.num_workers=2", "cluster.min_actor_ranks=3"], "cluster.min_actor_ranks"),
        (["cluster.min_rollout_workers=2"], "cluster.min_rollout_workers"),
        (["runner.recovery.shrink_after_s=-1"], "runner.recovery.shrink_after_s"),
        (["actor.num_workers=3", "actor.layout_invariant=true"], "power-of-two"),
        (["actor.layout_invariant=true", "actor.reduce_dtype=float16"], "actor.reduce_dtype"),
    ],
)
def test_bad_elastic_settings_are_refused_in_one_line(overrides, key):
    with pytest.raises(ConfigError, match=key):
        _cfg(*overrides)
