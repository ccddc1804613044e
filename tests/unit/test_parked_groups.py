"""The parked worker groups' bookkeeping (cluster/parked_groups.py), without Ray: groups are plain objects here."""

from __future__ import annotations

from rlrunner.cluster import parked_groups


class Group:
    def __init__(self, dead: bool = False):
        self.dead, self.shut = dead, False

    def dead_ranks(self, timeout_s: float) -> list[int]:
        return [0] if self.dead else []

    def shutdown(self) -> None:
        self.shut = True


def test_at_most_max_parked_groups_are_kept_and_the_oldest_goes_first():
    parked_groups.evict()
    groups = [Group() for _ in range(parked_groups.MAX_PARKED + 2)]
    for i, group in enumerate(groups):
        parked_groups.park(("shape", i), group)
    assert [g.shut for g in groups] == [True, True] + [False] * parked_groups.MAX_PARKED
    assert parked_groups.take(("shape", 0)) is None
    assert parked_groups.take(("shape", 2)) is groups[2] and not groups[2].shut
    assert parked_groups.evict() == parked_groups.MAX_PARKED - 1
    assert all(g.shut for g in groups[3:])


def test_a_group_parked_again_under_its_shape_replaces_the_old_one_and_a_dead_one_is_not_taken():
    parked_groups.evict()
    old, new, dead = Group(), Group(), Group(dead=True)
    parked_groups.park("a", old)
    parked_groups.park("a", new)
    assert old.shut and not new.shut
    parked_groups.park("b", dead)
    assert parked_groups.take("b") is None and dead.shut
    assert parked_groups.take("a") is new
    assert parked_groups.evict() == 0
