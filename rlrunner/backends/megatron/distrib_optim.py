"""AdamW with its state and gradients sharded over the data-parallel group (Megatron's "distributed optimizer" with
the gradients reduce-scattered, ZeRO stage 2; and the weights too with `shard_weights`, ZeRO-3).

Each rank of a tensor-parallel (TP) x data-parallel (DP) layout holds its TP shard of the model. The DP replicas
of one TP rank hold the same parameters, so they split the optimizer's work between them, in three parts:

* `flat_space.py`: the local parameters laid end to end, padded to a multiple of the DP size D; DP rank d owns
  elements [d*N/D, (d+1)*N/D). With whole weights the parameters are views of one fp32 buffer of that space;
* `grad_reducer.py`: the gradients, reduced over DP into the owned slice in backward (`shard_gradients`, the
  default: no rank holds the gradients of its whole TP shard), or kept whole and all_reduced once per step (ZeRO-1,
  Megatron-LM's distributed optimizer: 4 + 4 + 8/D bytes per parameter, one collective per step);
* `weight_units.py` (`shard_weights`): the weights kept as the owned slice only, each unit (embedding, layer, head)
  gathered from its owners around its use, so a rank holds 4/D + 4/D + 8/D bytes per parameter of its TP shard;
* here, the optimizer proper: the owned slice of the weights, cut into chunks, is what an inner `torch.optim.AdamW`
  steps (the "main" weights are the model's own: no copy), with the moments in two flat tensors of the slice's size,
  so a step's temporaries are one chunk. After a step with whole weights, one all_gather over DP into the buffer
  gives every replica the whole, identical update; with sharded weights nothing is exchanged.

One optimizer per set of parameters (the gradient hooks belong to the parameters). The gradient norm is the whole
model's (`GradientReducer.norm`).

A checkpoint gathers nothing on one rank: each DP rank hands its own slice of the flat weights and moments
(`own_slice`) to DP rank 0, which streams them into the one file chunk by chunk (`moment_save.py`), and a load reads
a rank's slice back from them at any DP size (`load_flat_state`), or, when the TP size changed, takes each
parameter's whole moment resharded like the weights (`load_full_state`, one tensor at a time).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from rlrunner.backends.megatron.flat_space import FlatSpace, bind_to_buffer
from rlrunner.backends.megatron.grad_reducer import BUCKET_ELEMENTS, GradientReducer
from rlrunner.backends.megatron.weight_units import WeightUnits

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's two state tensors, by their torch names
STEP_CHUNK_ELEMENTS = 1 << 20  # 4 MiB of fp32: the largest temporary of a step (and of an exchange over DP)


class DistributedAdamW:
    """AdamW over this rank's parameters whose state lives sharded across `dp_group` (see the module docstring)."""

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        dp_group: dist.ProcessGroup | None,
        tp_group: dist.ProcessGroup | None,
        replicated: set[str],
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        eps: float = 1e-8,
        device: torch.device | str | None = None,
        step_chunk_elements: int = STEP_CHUNK_ELEMENTS,
        shard_gradients: bool = True,
        bucket_elements: int = BUCKET_ELEMENTS,
        shard_weights: bool = False,
        units: Sequence[Sequence[str]] | None = None,
    ):
        """`named_params` (fp32) become views of this optimizer's buffer: their values are kept, or zero for parameters
        on the meta device (a model built there gets its storage here, and its weights are copied in afterwards).
        `shard_gradients`: keep the owned slice of the gradients only, each parameter's reduced in backward (ZeRO-2);
        False keeps the whole gradient buffer, all_reduced once by `reduce_gradients` (ZeRO-1: fewer collectives when
        backward runs several times per step, 4 + 4 + 8/D bytes per parameter).
        `shard_weights`: keep the owned slice of the weights only (ZeRO-3, needs `shard_gradients`); `units` are the
        parameter names of each unit gathered at once, consecutive runs of `named_params` covering all of them. At DP
        size 1 it changes nothing: the slice is everything, and stays gathered."""
        self.space = space = FlatSpace(named_params, dp_group, replicated)
        self.names, self.index, self.params = space.names, space.index, space.params
        self.tp_group = tp_group
        self.device = torch.device(device) if device is not None else self.params[0].device
        not_fp32 = [(name, param.dtype) for name, param in named_params if param.dtype != torch.float32]
        if not_fp32:
            raise ValueError(
                f"DistributedAdamW steps fp32 parameters in place, and {not_fp32[0][0]!r} is {not_fp32[0][1]}"
            )
        self.shard_gradients = shard_gradients and space.dp_size > 1
        self.shard_weights = shard_weights and space.dp_size > 1
        if self.shard_weights and not self.shard_gradients:
            raise ValueError(
                "shard_weights (ZeRO-3) needs shard_gradients: the whole gradients would outweigh the weights"
            )
        self.units: WeightUnits | None = None  # sharded weights: gathered a unit at a time
        if self.shard_weights:
            self.owned_params = torch.zeros(space.slice_size, dtype=torch.float32, device=self.device)
            for index, param in enumerate(self.params):  # values given (not on the meta device): their owned parts
                if param.device.type != "meta":
                    self.load_weight(self.names[index], param.detach())
            self.units = WeightUnits(space, units, self.owned_params, self.device)
        else:
            self.flat_params = bind_to_buffer(self.params, space.slice_size * space.dp_size, self.device)
            self.owned_params = self.flat_params[space.owned]
        self.grads = GradientReducer(space, self.shard_gradients, bucket_elements, self.device)
        # The inner AdamW steps the owned slice of the model's weights itself, cut into chunks: its per-element
        # temporaries (the square root of exp_avg_sq, the update) are one chunk, not the whole slice. The moments are
        # two flat tensors of the slice's size; each chunk's state is a view of them, made before AdamW would make its
        # own. foreach=False: the plain per-element AdamW, the same bits whatever chunk or slice an element falls in.
        self.chunks = [torch.nn.Parameter(view) for view in self.owned_params.split(step_chunk_elements)]
        self.moments = {key: torch.zeros(space.slice_size, dtype=torch.float32, device=self.device) for key in MOMENTS}
        self.optimizer = torch.optim.AdamW(
            self.chunks, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, foreach=False
        )
        self._set_chunk_state(0)

    # --- gradients ---------------------------------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        """Average the gradients over the DP group into the owned slice (a collective, every DP rank calls it)."""
        self.grads.reduce()

    def grad_norm(self) -> float:
        """L2 norm of the whole model's gradient; the same value on every rank (after `reduce_gradients`)."""
        return self.grads.norm(self.tp_group)

    def clip_and_step(self, max_norm: float) -> float:
        """Clip the gradient to `max_norm` (clip_grad_norm_'s rule) and take one AdamW step; returns the norm.

        A non-finite norm skips the step (nothing changes, the step count included) on every rank alike.
        """
        norm = self.grad_norm()
        if not math.isfinite(norm):
            return norm
        coef = min(1.0, max_norm / (norm + 1e-6))
        owned = self.grads.owned
        if coef < 1.0:
            owned.mul_(coef)
        for chunk, grad in zip(self.chunks, owned.split(self.chunks[0].numel())):
            chunk.grad = grad
        self.optimizer.step()  # updates this rank's slice of the model's weights in place
        for chunk in self.chunks:
            chunk.grad = None
        if self.space.dp_size > 1 and not self.shard_weights:  # every replica's slice into every replica's buffer
            self.space.exchange_slices(self.owned_params, self.flat_params, self.chunks[0].numel())
        return norm

    def zero_grad(self) -> None:
        """Zero the gradients. No collective."""
        self.grads.zero()

    # --- weights ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Set parameter `name` to `tensor` (its shape): sharded, only the elements this rank owns are copied; whole,
        the parameter itself. No collective: every replica loads the same values."""
        index = self.index[name]
        param = self.params[index]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        if not self.shard_weights:
            param.copy_(tensor)
        elif index in self.space.owned_parts:
            first, last = self.space.owned_parts[index]
            self.space.owned_part(index, self.owned_params).copy_(tensor.reshape(-1)[first:last])

    @torch.no_grad()
    def load_owned_weights(self, values: torch.Tensor) -> None:
        """Set the weights of this rank's own flat slice (sharded weights: all it holds) to `values`, the elements
        [start, stop) of `_own_range`; the padding past the last parameter stays zero. No collective."""
        if not self.shard_weights:
            raise ValueError("only sharded weights are held as the owned slice alone")
        start, stop = self._own_range()
        if tuple(values.shape) != (stop - start,):
            raise ValueError(f"owned weights of shape {tuple(values.shape)}, this rank owns {stop - start} elements")
        self.owned_params[: stop - start].copy_(values)
        self.owned_params[stop - start :].zero_()

    # --- state ---------------------------------------------------------------------------------------------

    def full_state(self) -> dict[str, Any]:
        """The whole (every DP slice) state of this TP rank, per parameter name, as CPU fp32 tensors of their own
        (views of one flat copy per moment): for tests and tools. Checkpoints never gather it (`own_slice`).

        A collective over the DP group: every DP rank must call it, and every one gets the result.
        """
        result: dict[str, Any] = {"step": self._step_count()}
        space = self.space
        for key in MOMENTS:
            full = self.moments[key].clone() if space.dp_size == 1 else space.padded(self.device)
            if space.dp_size > 1:
                space.exchange_slices(self.moments[key], full, self.chunks[0].numel())
            result[key] = dict(zip(self.names, space.views(full.to("cpu"))))
        return result

    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter, in the flat order the moments are sliced in."""
        return [(name, tuple(param.shape)) for name, param in zip(self.names, self.params)]

    def own_slice(self, copy: bool) -> dict[str, Any]:
        """What this DP rank writes to a checkpoint, with no collective: the step count, the elements [start, stop) of
        the flat space it owns (clipped to the parameters: no padding) and the weights (`param`) and both moments over
        them, views of the live state (a synchronous save writes them before the next step) or, with `copy`, tensors
        of their own."""
        start, stop = self._own_range()
        state = {"param": self.owned_params, **self.moments}
        state = {key: tensor[: stop - start] for key, tensor in state.items()}
        if copy:
            state = {key: tensor.clone() for key, tensor in state.items()}
        return {"step": self._step_count(), "start": start, "stop": stop, **state}

    @torch.no_grad()
    def load_flat_state(
        self, step: int, layout: Sequence[tuple[str, tuple[int, ...]]], read: Callable[[str, int, int], torch.Tensor]
    ) -> None:
        """Load moments saved by an optimizer of the same parameters at any DP size: `read(key, start, stop)` gives
        elements [start, stop) of moment `key`'s flat vector (the parameters flattened in `layout`'s order, no
        padding). This rank reads its own slice only. ValueError if `layout` is not this optimizer's."""
        mine = self.layout()
        if [(name, tuple(shape)) for name, shape in layout] != mine:
            theirs = dict((name, tuple(shape)) for name, shape in layout)
            differ = next(
                (
                    f"{name!r} {shape} saved as {theirs[name]}" if name in theirs else f"{name!r} is not saved"
                    for name, shape in mine
                    if theirs.get(name) != shape
                ),
                f"the saved order or an extra parameter ({len(layout)} saved, {len(mine)} here)",
            )
            raise ValueError(f"optimizer state was saved for other parameters: {differ}")
        start, stop = self._own_range()
        for key in MOMENTS:
            part = read(key, start, stop)
            if tuple(part.shape) != (stop - start,):
                raise ValueError(f"optimizer state {key}: elements {start}:{stop} read as shape {tuple(part.shape)}")
            self.moments[key][: stop - start].copy_(part)
            self.moments[key][stop - start :].zero_()  # the padding past the last parameter
        self._set_chunk_state(step)

    @torch.no_grad()
    def load_full_state(self, state: Mapping[str, Any]) -> None:
        """Load what `full_state` returned (at any DP size): each DP rank copies its own slice out of each tensor.

        Each moment is a dict, checked whole before anything is copied, or (name, tensor) pairs read one at a time
        (a resharding load streams them), checked as they come: then a ValueError may leave the state partly loaded.
        Either way no whole flat copy of the moments is made."""
        step = self._check_state(state)
        space = self.space
        start, stop = space.owned.start, space.owned.stop
        for key in MOMENTS:
            given = state[key]
            loaded: set[str] = set()
            for name, tensor in given.items() if isinstance(given, Mapping) else given:
                index = self.index.get(name)
                if index is None:
                    raise ValueError(f"optimizer state {key} has unknown parameter {name!r}")
                self._check_shape(key, name, tensor, self.params[index])
                lo, hi = space.offsets[index], space.offsets[index + 1]
                first, last = max(lo, start), min(hi, stop)
                if first < last:  # the part of this parameter in this rank's slice
                    self.moments[key][first - start : last - start].copy_(tensor.reshape(-1)[first - lo : last - lo])
                loaded.add(name)
            missing = [name for name in self.names if name not in loaded]
            if missing:
                raise ValueError(f"optimizer state {key} lacks parameter {missing[0]!r}")
            if stop > space.numel:
                self.moments[key][max(space.numel, start) - start :].zero_()  # the padding past the last parameter
        self._set_chunk_state(step)

    def local_state(self) -> dict[str, Any]:
        """This DP rank's own part of the state, live (no collective): the step count and its slice of the moments
        (its weights are the model's; sharded, its slice of them too)."""
        weights = {"weights": self.owned_params} if self.shard_weights else {}
        return {"step": self._step_count(), **self.moments, **weights}

    @torch.no_grad()
    def load_local_state(self, state: dict[str, Any]) -> None:
        """Put back what `local_state` gave, on the same DP rank of the same layout (the model's weights of the same
        moment are loaded into the model)."""
        mine = {**self.moments, **({"weights": self.owned_params} if self.shard_weights else {})}
        for key, tensor in mine.items():
            if key not in state or tuple(state[key].shape) != tuple(tensor.shape):
                got = tuple(state[key].shape) if key in state else "nothing"
                raise ValueError(
                    f"optimizer state {key} has shape {got}, this rank's slice is {tuple(tensor.shape)}: "
                    "not the same layout"
                )
            tensor.copy_(state[key])
        self._set_chunk_state(int(state["step"]))
        self.zero_grad()  # the state has no gradients: none left by an interrupted step may count in the next

    def _set_chunk_state(self, step: int) -> None:
        """Each chunk's AdamW state: the step count, and its views of the flat moments."""
        size = self.chunks[0].numel()
        views = {key: flat.split(size) for key, flat in self.moments.items()}
        for index, chunk in enumerate(self.chunks):
            # the step as AdamW keeps it (a float32 scalar tensor on the CPU); the moments as views, so AdamW updates
            # the flat tensors in place
            self.optimizer.state[chunk] = {
                "step": torch.tensor(float(step), dtype=torch.float32),
                **{key: views[key][index] for key in MOMENTS},
            }

    def _step_count(self) -> int:
        return _step_of(self.optimizer.state[self.chunks[0]])

    def param_groups_state(self) -> dict[str, Any]:
        """The hyperparameters and step count as plain Python values (the checkpoint's `optimizer` entry)."""
        group = self.optimizer.param_groups[0]
        return {
            "lr": float(group["lr"]),
            "betas": tuple(float(b) for b in group["betas"]),
            "eps": float(group["eps"]),
            "weight_decay": float(group["weight_decay"]),
            "step": self._step_count(),
        }

    def _own_range(self) -> tuple[int, int]:
        """The flat elements [start, stop) this DP rank owns, clipped to the parameters (no padding)."""
        owned, numel = self.space.owned, self.space.numel
        return min(owned.start, numel), min(owned.stop, numel)

    def _check_state(self, state: Mapping[str, Any]) -> int:
        """The state's step count; ValueError naming the first key that does not fit this optimizer (every tensor of
        a moment given as a dict; pairs are checked as they are read)."""
        for key in ("step", *MOMENTS):
            if key not in state:
                raise ValueError(f"optimizer state lacks {key!r}")
        step = state["step"]
        if isinstance(step, torch.Tensor):
            step = step.item()
        if isinstance(step, bool) or not float(step).is_integer() or step < 0:
            raise ValueError(f"optimizer state step {state['step']!r} is not a count of steps")
        for key in MOMENTS:
            tensors = state[key]
            if not isinstance(tensors, Mapping):
                continue
            for name, param in zip(self.names, self.params):
                if name not in tensors:
                    raise ValueError(f"optimizer state {key} lacks parameter {name!r}")
                self._check_shape(key, name, tensors[name], param)
            extra = sorted(set(tensors) - set(self.names))
            if extra:
                raise ValueError(f"optimizer state {key} has unknown parameter {extra[0]!r}")
        return int(step)

    @staticmethod
    def _check_shape(key: str, name: str, tensor: torch.Tensor, param: torch.Tensor) -> None:
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"optimizer state {key}[{name!r}] has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )


def _step_of(state: dict[str, Any]) -> int:
    step = state.get("step", 0)
    return int(step.item() if isinstance(step, torch.Tensor) else step)
