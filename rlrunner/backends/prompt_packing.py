"""Rows that share a prompt, packed: the update's forward reads each distinct prompt of a micro-batch once.

GRPO samples `algorithm.group_size` responses per prompt, so most rows of an update begin with the same tokens. Packed,
the rows of a micro-batch that share a prompt become one sequence: the prompt but its last token, then each row's own
copy of that last token followed by its response. A mask lets each row's part see the shared prompt and its own earlier
tokens only, its positions continuing the prompt's, so every logit is the unpacked row's up to rounding.
`PackedRows.gather` puts them back at the rows' [width - 1] positions: the loss and everything after it are unchanged.

Each logit a loss reads (from the prompt's last token on) is a row's own: two rows read the same packed position only
where no loss does (the prompt's earlier positions, padding targets), so their gradients, summed back in whatever
order a device's indexing backward takes (atomics, threads), are one value plus exact zeros, the same bits every time.

The mask is explicit, so attention works over the whole packed sequence (quadratic in its length) where the unpacked
rows' causal kernels work over each row. `PromptPacker` packs only where an estimate of the forward's work
(`ForwardCost`) says that saves: short responses after a shared prompt, not thousands of tokens each.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Sequence

import torch

# Packing must save at least this share of the forward's estimated work: the mask, the gather and their backward cost
# something the estimate leaves out (on the default job's passes the estimate said 0.74 and a forward and backward
# took 0.73 of the unpacked time).
MIN_SAVING = 0.1


@dataclass(frozen=True)
class PackedRows:
    """A micro-batch's rows packed by prompt (`pack_shared_prompts`)."""

    input_ids: torch.Tensor  # [packed rows, packed width]
    position_ids: torch.Tensor  # [packed rows, packed width]
    attention_mask: torch.Tensor  # [packed rows, 1, packed width, packed width] bool, True: may attend
    source_rows: torch.Tensor  # [rows, width - 1]: the packed row whose logits predict each row's next token there
    source_columns: torch.Tensor  # [rows, width - 1]: and the column

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """Packed logits [packed rows, packed width, vocab] -> the rows' next-token logits [rows, width - 1, vocab]."""
        return logits[self.source_rows, self.source_columns]

    def to(self, device: torch.device) -> "PackedRows":
        return PackedRows(*(t.to(device) for t in vars(self).values()))


def prompt_groups(input_ids: torch.Tensor, prompt_lengths: Sequence[int]) -> list[list[int]]:
    """The rows of `input_ids` [rows, width] grouped by their prompt (the first `prompt_lengths[r]` tokens of row r),
    in order of first appearance. A group larger than the median (a prompt drawn twice in one batch) is cut into runs
    no larger than it: each group is one packed sequence, and every sequence is padded to the longest."""
    ids = input_ids.tolist()
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for row, prompt_length in enumerate(prompt_lengths):
        by_prompt.setdefault(tuple(ids[row][:prompt_length]), []).append(row)
    size = statistics.median_low(len(group) for group in by_prompt.values())
    return [group[i : i + size] for group in by_prompt.values() for i in range(0, len(group), size)]


def packed_width(group: Sequence[int], prompt_lengths: Sequence[int], lengths: Sequence[int]) -> int:
    """The length of one packed sequence: the group's prompt but its last token, then each of its rows' last prompt
    token and response."""
    shared = prompt_lengths[group[0]] - 1
    return shared + sum(lengths[row] - shared for row in group)


def pack_shared_prompts(
    input_ids: torch.Tensor, prompt_lengths: Sequence[int], lengths: Sequence[int], groups: Sequence[Sequence[int]]
) -> PackedRows:
    """The right-padded rows `input_ids` [rows, width] (row r: a prompt of `prompt_lengths[r]` tokens, then its
    response, `lengths[r]` tokens in all) packed one sequence per group of rows with the same prompt (`prompt_groups`).

    Each row's logits at positions 0..width-2 come from: the shared prompt's positions before its last, then the row's
    own part (its copy of the prompt's last token, which predicts the first response token, and its response tokens);
    a position past its last token (a padding target, masked out of every loss) reads its last token's."""
    rows, width = input_ids.shape
    ids = input_ids.tolist()
    sizes = [packed_width(group, prompt_lengths, lengths) for group in groups]
    full = max(sizes)
    tokens, positions, segments = [], [], []  # per packed row; segment 0 is the prompt, k the k-th response
    columns: list[list[int]] = [[] for _ in range(rows)]
    sources: list[int] = [0] * rows
    steps = range(width - 1)
    for packed, (group, size) in enumerate(zip(groups, sizes)):
        shared = prompt_lengths[group[0]] - 1  # the prompt's tokens before its last
        row_tokens, row_positions, row_segments = ids[group[0]][:shared], list(range(shared)), [0] * shared
        start = shared
        for k, row in enumerate(group, start=1):
            own = lengths[row] - shared  # the last prompt token and the response
            row_tokens += ids[row][shared : lengths[row]]
            row_positions += range(shared, lengths[row])
            row_segments += [k] * own
            last = start + own - 1
            columns[row] = [j if j < shared else min(start + j - shared, last) for j in steps]
            sources[row] = packed
            start += own
        padding = full - size
        tokens.append(row_tokens + [0] * padding)
        positions.append(row_positions + [0] * padding)
        segments.append(row_segments + [-1 - c for c in range(padding)])  # a padding position sees itself only
    segment = torch.tensor(segments)
    query, key = segment[:, :, None], segment[:, None, :]
    causal = torch.ones(full, full, dtype=torch.bool).tril()
    mask = causal & ((query == key) | ((key == 0) & (query > 0)))
    return PackedRows(
        input_ids=torch.tensor(tokens, dtype=input_ids.dtype),
        position_ids=torch.tensor(positions, dtype=torch.long),
        attention_mask=mask[:, None],
        source_rows=torch.tensor(sources, dtype=torch.long)[:, None].expand(rows, width - 1),
        source_columns=torch.tensor(columns, dtype=torch.long).view(rows, width - 1),
    )


@dataclass(frozen=True)
class ForwardCost:
    """A decoder layer's forward work: per token (its projections and MLP: 2 x their weights' elements) and per
    query-key pair its attention computes (scores and weighted values: 4 x the query heads' width)."""

    per_token: int
    per_pair: int

    @classmethod
    def from_config(cls, config: Any) -> "ForwardCost":
        """From an HF decoder config (hidden_size, num_attention_heads, and where present num_key_value_heads,
        head_dim, intermediate_size)."""
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        ffn = int(getattr(config, "intermediate_size", None) or 4 * hidden)
        weights = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * ffn
        return cls(per_token=2 * weights, per_pair=4 * heads * head_dim)

    def unpacked(self, rows: int, width: int) -> int:
        """`rows` rows padded to `width`, each attending causally (a causal kernel skips the upper triangle)."""
        return rows * (width * self.per_token + width * (width + 1) // 2 * self.per_pair)

    def packed(self, count: int, width: int) -> int:
        """`count` packed rows of `width`, each attending over its whole width (an explicit mask is computed
        everywhere)."""
        return count * (width * self.per_token + width * width * self.per_pair)


class PromptPacker:
    """`actor.pack_shared_prompts`: True packs every micro-batch whose rows share a prompt, False none, None (auto)
    those where `cost` estimates the packed forward at most 1 - MIN_SAVING of the unpacked one."""

    def __init__(self, setting: bool | None, cost: ForwardCost):
        self.setting, self.cost = setting, cost

    def pack(self, input_ids: torch.Tensor, prompt_lengths: Sequence[int], lengths: Sequence[int]) -> PackedRows | None:
        """The micro-batch's rows packed, or None where they are not (the setting; no shared prompt; no saving)."""
        if self.setting is False:
            return None
        groups = prompt_groups(input_ids, prompt_lengths)
        if len(groups) == len(lengths):
            return None
        if self.setting is None:
            width = max(packed_width(group, prompt_lengths, lengths) for group in groups)
            unpacked = self.cost.unpacked(len(lengths), input_ids.shape[1])
            if self.cost.packed(len(groups), width) > (1 - MIN_SAVING) * unpacked:
                return None
        return pack_shared_prompts(input_ids, prompt_lengths, lengths, groups)
