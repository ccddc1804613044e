"""The parked worker groups' bookkeeping (cluster/parked_groups.py), without Ray: groups are plain objects here."""

from __future__ import annotations

from rlrunner.cluster import parked_groups


class Group:
    def __init__(self, dead: bool = False, workers: int = 2):
        self.dead, self.shut = dead, False
        self.workers = [object()] * workers

    def dead_ranks(self, timeout_s: float) -> list[int]:
        return [0] if self.dead else []

    def shutdown(self) -> None:
        self.shut = True


def test_at_most_max_parked_workers_are_kept_in_whole_groups_and_the_oldest_go_first():
    parked_groups.evict()
    pairs = parked_groups.MAX_PARKED_WORKERS // 2
    groups = [Group() for _ in range(pairs + 2)]
    for i, group in enumerate(groups):
        parked_groups.park(("shape", i), group)
    assert [g.shut for g in groups] == [True, True] + [False] * pairs
    assert parked_groups.take(("shape", 0)) is None
    assert parked_groups.take(("shape", 2)) is groups[2] and not groups[2].shut
    big = Group(workers=5)  # room for it: the two oldest groups go, not only one
    parked_groups.park("big", big)
    assert [g.shut for g in groups[3:]] == [True, True] + [False] * (pairs - 3) and not big.shut
    assert parked_groups.evict() == pairs - 3 + 1
    assert all(g.shut for g in groups[3:]) and big.shut


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


def test_the_cap_passes_over_what_holds_no_worker():
    parked_groups.evict()
    holder = Group(workers=0)  # a kept snapshot holder: not counted, so shutting it down would free nothing
    parked_groups.park("holder", holder)
    groups = [Group() for _ in range(parked_groups.MAX_PARKED_WORKERS // 2 + 1)]
    for i, group in enumerate(groups):
        parked_groups.park(("shape", i), group)
    assert groups[0].shut and not any(g.shut for g in groups[1:]) and not holder.shut
    assert parked_groups.evict() == len(groups)
