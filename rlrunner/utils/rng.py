"""This process's random number generator states, captured and restored (for checkpoints).

The state is plain data that `torch.load(weights_only=True)` reads: tensors, tuples and numbers
(numpy's MT19937 key is held as an int64 tensor, not a numpy array).
"""

from __future__ import annotations

import random
from typing import Any

import torch


def capture_rng() -> dict[str, Any]:
    """{"torch", "python", "numpy", and "cuda" (every device's state, stacked) where CUDA is}."""
    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss)),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what `capture_rng` took (the CUDA states only where CUDA is)."""
    import numpy as np

    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
