"""Batched autoregressive sampling with a KV cache, where every row draws from its own seeded generator.

Each row (one sample of one prompt) owns a `torch.Generator` seeded from (run seed, step, prompt
index, sample index) and draws one uniform number per token (all of them at the start: `row_uniforms`);
the token is picked by inverse-CDF over the temperature-scaled, top-p-filtered distribution. So what a
row samples depends on its seed and the model alone, never on which worker generated it or what else
was in its batch.
Each token's log-probability is taken from the raw distribution (before temperature and top-p).
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch

from rlrunner.rollout.base import Completion


def row_uniforms(generators: Sequence[torch.Generator], count: int) -> torch.Tensor:
    """[R, count]: row r's next `count` uniform numbers from `generators[r]`, drawn in one call per row. They are the
    numbers `count` draws of one each would give (a CPU generator fills a tensor in order; a unit test holds torch to
    it): one `torch.rand` per row and token cost 5% of a rollout worker's time on the default job."""
    return torch.stack([torch.rand(count, generator=g) for g in generators])


def sample_tokens(
    logits: torch.Tensor, uniforms: torch.Tensor | None, temperature: float, top_p: float
) -> torch.Tensor:
    """One token per row of `logits` [R, V]: greedy when temperature == 0, else top-p sampling by inverse CDF at row
    r's uniform number `uniforms[r]` (unused when greedy)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True, stable=True)
    if top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (the most likely token always stays)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs * (mass_before < top_p)
    cumulative = sorted_probs.cumsum(dim=-1)
    targets = (uniforms * cumulative[:, -1]).unsqueeze(-1)
    choice = torch.searchsorted(cumulative, targets, right=True).squeeze(-1)
    last_kept = (sorted_probs > 0).sum(dim=-1) - 1
    choice = torch.minimum(choice, last_kept)
    return sorted_ids.gather(-1, choice.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    pad_id: int,
    eos_ids: Sequence[int],
    row_limits: Sequence[int] | None = None,
) -> list[Completion]:
    """Sample one response per row; row r continues `prompts[r]` using a generator seeded with `seeds[r]`.

    Prompts are left-padded into one batch. A response ends with its first eos token (kept, so the
    policy learns to stop) or after `max_new_tokens` tokens (`row_limits[r]`, at most that, where given).
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    rows = len(prompts)
    # Each distinct prompt is read once (a group's samples share theirs); its cache and last logits then serve every
    # row that continues it.
    distinct: dict[tuple[int, ...], int] = {}
    source = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts], device=device)
    width = max(len(p) for p in distinct)
    input_ids = torch.full((len(distinct), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(distinct), width), dtype=torch.long)
    for u, prompt in enumerate(distinct):
        input_ids[u, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[u, width - len(prompt) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
    uniforms = row_uniforms(generators, max_new_tokens) if temperature != 0 else None
    stop = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)

    cache = DynamicCache(config=model.config)
    forward_parameters = inspect.signature(model.forward).parameters
    # the KV cache's name in the forward and its output: `cache` from transformers 5.2x on (where `past_key_values`
    # warns that it goes in 5.40), `past_key_values` before
    cache_name = "cache" if "cache" in forward_parameters else "past_key_values"
    # the prompt pass needs the last position's logits only, where the model can be asked for just those
    last_logits = {"logits_to_keep": 1} if "logits_to_keep" in forward_parameters else {}
    responses: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    limits = None if row_limits is None else torch.tensor(list(row_limits), dtype=torch.long, device=device)
    step_ids, step_positions = input_ids, position_ids
    for token in range(max_new_tokens):
        out = model(
            input_ids=step_ids,
            attention_mask=attention_mask,
            position_ids=step_positions,
            **{cache_name: cache},
            use_cache=True,
            **last_logits,
        )
        logits = out.logits[:, -1, :]
        if token == 0:  # from the distinct prompts to the rows
            logits = logits.index_select(0, source)
            getattr(out, cache_name).reorder_cache(source)
            attention_mask, step_positions = attention_mask[source], step_positions[source]
        logits = logits.cpu()
        sampled = sample_tokens(logits, None if uniforms is None else uniforms[:, token], temperature, top_p)
        token_logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
        sampled = sampled.to(device)
        next_ids = torch.where(finished, torch.full_like(sampled, pad_id), sampled)
        # one conversion per step, not two tensor reads per row: at 128 rows those cost about 1 ms a token
        ids_now, logprobs_now = next_ids.tolist(), token_logprobs.tolist()
        for r in (~finished).nonzero().flatten().tolist():
            responses[r].append(ids_now[r])
            logprobs[r].append(logprobs_now[r])
        finished |= torch.isin(next_ids, stop)
        if limits is not None:
            finished |= limits <= token + 1
        if bool(finished.all()):
            break
        cache = getattr(out, cache_name)
        step_ids = next_ids.unsqueeze(-1)
        step_positions = step_positions[:, -1:] + 1
        attention_mask = torch.cat([attention_mask, torch.ones((rows, 1), dtype=torch.long, device=device)], dim=-1)
    return [Completion(tokens, lps) for tokens, lps in zip(responses, logprobs)]
