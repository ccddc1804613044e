"""docs/architecture.md's "Add a training backend" held to the code: the members its steps 2 and 4 name are exactly
the abstract ones, and a backend written from the guide (those members and nothing else) is made through a lazy
registry entry, its worker class instantiable."""

from __future__ import annotations

import inspect
import re
import sys
import types
from pathlib import Path

import pytest

from rlrunner.backends import registry
from rlrunner.backends.actor import ActorWorker
from rlrunner.backends.base import TrainingBackend

from conftest import actor_worker_kwargs, run_config

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def guide_step(number: int) -> str:
    text = GUIDE.read_text()
    section = text[text.index("## Add a training backend") :]
    section = section[: section.index("\n## ", 1)]
    return section[section.index(f"\n{number}. ") : section.index(f"\n{number + 1}. ")]


def named_members(step: str) -> list[str]:
    """The members listed after "the abstract members", up to the end of that sentence: each backticked name (a
    call's name before its parenthesis)."""
    rest = step[step.index("abstract members") :]
    masked = re.sub(r"`[^`]*`", lambda m: "x" * len(m.group()), rest)  # a period inside backticks ends nothing
    sentence = rest[: re.search(r"\.\s", masked).start()]
    return [re.match(r"\w+", span).group() for span in re.findall(r"`([^`]*)`", sentence)]


def test_the_guide_names_exactly_the_abstract_members() -> None:
    assert sorted(named_members(guide_step(2))) == sorted(ActorWorker.__abstractmethods__)
    assert sorted(named_members(guide_step(4))) == sorted(TrainingBackend.__abstractmethods__)


def guide_worker() -> type:
    """An actor worker with the guide's members, each doing nothing."""
    members = {
        name: (property(lambda self: 1) if name == "data_parallel_size" else lambda self, *args: None)
        for name in named_members(guide_step(2))
    }
    return type("GuideWorker", (ActorWorker,), members)


def test_a_backend_written_from_the_guide_is_made_from_its_registry_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    worker = guide_worker()
    members = {name: (lambda self, *args: None) for name in named_members(guide_step(4))}
    members.update(name="guide", checkpoint_format="guide", worker_class=property(lambda self: worker))
    module = types.ModuleType("guide_backend")
    module.GuideBackend = type("GuideBackend", (TrainingBackend,), members)
    monkeypatch.setitem(sys.modules, "guide_backend", module)
    monkeypatch.setitem(registry.BACKENDS, "guide", "guide_backend:GuideBackend")  # step 5: one line
    registry.get_backend.cache_clear()
    try:
        backend = registry.get_backend("guide")
        assert isinstance(backend, module.GuideBackend) and registry.get_backend("guide") is backend
        assert backend.rank_map({"num_workers": 4, "tensor_model_parallel_size": 2}) == registry.get_backend(
            "fsdp"
        ).rank_map({"num_workers": 4, "tensor_model_parallel_size": 2})
        made = backend.worker_class(
            0, 1, **actor_worker_kwargs(run_config(tmp_path))
        )  # abstract members missing would raise TypeError here
        assert made.data_parallel_size == 1
    finally:
        registry.get_backend.cache_clear()


def test_a_worker_missing_a_member_of_the_guide_cannot_be_made(tmp_path: Path) -> None:
    members = dict(vars(guide_worker()))
    del members["state_parts"]
    with pytest.raises(TypeError, match="state_parts"):
        type("Incomplete", (ActorWorker,), members)(0, 1, **actor_worker_kwargs(run_config(tmp_path)))


def test_every_registered_backend_is_made_from_its_entry() -> None:
    for name, entry in registry.BACKENDS.items():
        backend = registry.get_backend(name)
        assert backend.name == name and f"{type(backend).__module__}:{type(backend).__name__}" == entry
        assert not inspect.isabstract(type(backend))
