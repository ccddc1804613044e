"""Randomness derived from counters: a seed for any tuple of (run seed, step, index, ...)."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that depends on every part and on their order, stable across processes and runs.

    Used so that a step replayed after a restart draws exactly the same random numbers: the sampling
    of (seed, step, prompt, sample) and the shuffle of (seed, epoch) never depend on hidden state.
    """
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
