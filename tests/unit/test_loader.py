"""The resumable, epoch-shuffling prompt loader and its sampler (the datasets: test_data.py)."""

import io

import pytest
import torch

from rlrunner.data.loader import EpochShuffleSampler, PromptLoader

# --- EpochShuffleSampler ---------------------------------------------------------------------------


def test_sampler_epochs_are_permutations_and_differ() -> None:
    sampler = EpochShuffleSampler(20, seed=3)
    epochs = [list(sampler) for _ in range(4)]
    for order in epochs:
        assert sorted(order) == list(range(20))
    assert len({tuple(order) for order in epochs}) == 4
    assert epochs[0] != list(range(20))
    assert sampler.epoch == 4 and sampler.position == 0


def test_sampler_order_depends_only_on_seed_and_epoch() -> None:
    a = EpochShuffleSampler(20, seed=3)
    consumed = [list(a) for _ in range(3)]
    fresh = EpochShuffleSampler(20, seed=3)
    assert [fresh.order(e) for e in range(3)] == consumed
    assert [fresh.order(e) for e in (2, 0, 2, 1)] == [
        consumed[2],
        consumed[0],
        consumed[2],
        consumed[1],
    ]  # any order asked
    assert EpochShuffleSampler(20, seed=4).order(0) != consumed[0]
    assert EpochShuffleSampler(20, seed=3, shuffle=False).order(5) == list(range(20))


def test_sampler_state_round_trip_and_mismatch() -> None:
    a = EpochShuffleSampler(10, seed=1)
    it = iter(a)
    first = [next(it) for _ in range(4)]
    state = a.state_dict()
    assert state == {"epoch": 0, "position": 4, "seed": 1, "size": 10}
    rest = list(it)
    b = EpochShuffleSampler(10, seed=1)
    b.load_state_dict(state)
    assert list(b) == rest
    assert first + rest == a.order(0)
    with pytest.raises(ValueError, match="11 prompts"):
        EpochShuffleSampler(11, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed 2"):
        EpochShuffleSampler(10, seed=2).load_state_dict(state)


# --- PromptLoader ----------------------------------------------------------------------------------

SIZE, BATCH, SEED = 10, 3, 5  # 3 batches per epoch, 1 leftover prompt dropped


def make_dataset(size: int = SIZE) -> list[dict]:
    return [{"index": i} for i in range(size)]


def indices(batch: list[dict]) -> list[int]:
    return [record["index"] for record in batch]


def run(loader: PromptLoader, steps: int) -> list[list[int]]:
    return [indices(loader.next_batch()) for _ in range(steps)]


def torch_round_trip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_loader_epochs_drop_leftovers_and_follow_the_sampler_order() -> None:
    loader = PromptLoader(make_dataset(), BATCH, SEED)
    assert loader.steps_per_epoch == 3
    batches = run(loader, 9)
    assert all(len(b) == BATCH for b in batches)
    orders = [loader.sampler.order(e) for e in range(3)]
    for epoch in range(3):
        flat = [i for b in batches[3 * epoch : 3 * epoch + 3] for i in b]
        assert flat == orders[epoch][:9]  # the 10th prompt of each epoch is dropped
        assert len(set(flat)) == 9
    assert len({tuple(order) for order in orders}) == 3  # each epoch its own order


def test_loader_epoch_property() -> None:
    loader = PromptLoader(make_dataset(), BATCH, SEED)
    assert loader.epoch == 0
    seen = []
    for _ in range(7):
        loader.next_batch()
        seen.append(loader.epoch)
    # read after next_batch, `epoch` is the epoch of the batch just returned
    assert seen == [0, 0, 0, 1, 1, 1, 2]


def test_loader_order_depends_only_on_seed() -> None:
    a = run(PromptLoader(make_dataset(), BATCH, SEED), 6)
    b = run(PromptLoader(make_dataset(), BATCH, SEED), 6)
    c = run(PromptLoader(make_dataset(), BATCH, SEED + 1), 6)
    assert a == b
    assert a != c
    assert run(PromptLoader(make_dataset(), BATCH, SEED, shuffle=False), 4) == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
        [0, 1, 2],
    ]


@pytest.mark.parametrize("taken_after", [0, 1, 2, 3, 4, 5, 7])
def test_loader_resume_matches_uninterrupted(taken_after: int) -> None:
    total = 10
    reference = PromptLoader(make_dataset(), BATCH, SEED)
    expected = run(reference, total)

    loader = PromptLoader(make_dataset(), BATCH, SEED)
    assert run(loader, taken_after) == expected[:taken_after]
    state = torch_round_trip(loader.state_dict())
    # the original keeps going unchanged after state_dict()
    assert run(loader, total - taken_after) == expected[taken_after:]

    resumed = PromptLoader(make_dataset(), BATCH, SEED)
    resumed.load_state_dict(state)
    assert run(resumed, total - taken_after) == expected[taken_after:]


def test_loader_resume_after_last_full_batch_starts_next_epoch() -> None:
    for size in (SIZE, 9):  # with leftovers dropped, and with an exact multiple of the batch size
        reference = PromptLoader(make_dataset(size), BATCH, SEED)
        expected = run(reference, 6)
        loader = PromptLoader(make_dataset(size), BATCH, SEED)
        run(loader, 3)  # the whole of epoch 0
        resumed = PromptLoader(make_dataset(size), BATCH, SEED)
        resumed.load_state_dict(torch_round_trip(loader.state_dict()))
        next_batch = indices(resumed.next_batch())
        assert next_batch == resumed.sampler.order(1)[:BATCH]
        assert next_batch == expected[3]
        assert resumed.epoch == 1
        assert run(resumed, 2) == expected[4:6]


def test_loader_state_dict_of_resumed_loader_resumes_again() -> None:
    expected = run(PromptLoader(make_dataset(), BATCH, SEED), 8)
    first = PromptLoader(make_dataset(), BATCH, SEED)
    run(first, 2)
    second = PromptLoader(make_dataset(), BATCH, SEED)
    second.load_state_dict(torch_round_trip(first.state_dict()))
    assert run(second, 2) == expected[2:4]
    third = PromptLoader(make_dataset(), BATCH, SEED)
    third.load_state_dict(torch_round_trip(second.state_dict()))
    assert run(third, 4) == expected[4:8]


def test_loader_state_survives_weights_only_load() -> None:
    loader = PromptLoader(make_dataset(), BATCH, SEED)
    run(loader, 4)
    state = loader.state_dict()
    loaded = torch_round_trip(state)
    assert loaded == state


@pytest.mark.parametrize(("size", "seed"), [(SIZE + 1, SEED), (SIZE, SEED + 1)])
def test_loader_state_for_other_dataset_or_seed_raises(size: int, seed: int) -> None:
    loader = PromptLoader(make_dataset(), BATCH, SEED)
    run(loader, 2)
    state = torch_round_trip(loader.state_dict())
    other = PromptLoader(make_dataset(size), BATCH, seed)
    with pytest.raises(ValueError, match="data position was saved for a dataset of 10 prompts with seed 5"):
        other.load_state_dict(state)  # refused at load time, before any batch is drawn
