"""AdamW with its state and gradients sharded over the data-parallel group (Megatron's "distributed optimizer" with
the gradients reduce-scattered, ZeRO stage 2).

Each rank of a tensor-parallel (TP) x data-parallel (DP) layout holds its TP shard of the model. The DP replicas
of one TP rank hold the same parameters, so they split the optimizer's work between them:

* the local parameters are views of one fp32 buffer (in the given order) of N elements, padded to a multiple of
  the DP size D; DP rank d owns elements [d*N/D, (d+1)*N/D);
* the gradients are kept for the owned slice only (`shard_gradients`, the default): as soon as backward has
  accumulated a parameter's gradient, a hook takes it and drops the `.grad`: a parameter larger than a bucket
  (16 MiB) is reduced over DP onto the ranks owning its elements at once, smaller ones wait in the bucket, which is
  all_reduced when full and at the end of the backward; the owned parts are added into the gradient slice (FSDP
  too reduces every micro-batch). So no rank ever holds the gradients of its whole TP shard, only one parameter's
  and the bucket. Without it (ZeRO-1, Megatron-LM's distributed optimizer) the gradients are views of a second
  whole buffer, all_reduced once per step: 4 + 4 + 8/D bytes per parameter, and one collective per step instead of
  a few per backward. At DP size 1 the two are the same: the slice is everything and `.grad` are views of it;
* the owned slice of the parameter buffer, cut into chunks, is what an inner `torch.optim.AdamW` steps (the "main"
  weights are the model's own: no copy), with the moments in two flat tensors of the slice's size, so a rank holds
  4 + 4/D + 8/D bytes per parameter of its TP shard, and a step's temporaries are one chunk;
* after a step each replica has updated its slice in place, and one all_gather over DP into the buffer gives every
  replica the whole, identical update;
* with `shard_weights` (ZeRO-3) a rank keeps only its slice of the weights too, and no whole buffer: the parameters
  are grouped in units (the model's embedding, each layer, the head: `units`), each a view of a buffer of its own
  whose storage is empty except while the unit is gathered (`gather`, `release`): the owners of its elements
  broadcast them over DP. The model gathers a unit before using it and releases it after, in forward and again in
  backward (`TPQwen2ForCausalLM.weight_units`), so a rank holds 4/D + 4/D + 8/D bytes per parameter of its TP shard,
  the share, and one or two units. The step updates the owned slice, and nothing is exchanged after it.

Every parameter must get a gradient in every backward (the hooks are collectives over DP, run in backward's order,
the same on every replica), as Megatron's and torch's DDP require by default. The hooks belong to the parameters:
one optimizer per set of parameters (a `.grad` that no hook took is still reduced, by `reduce_gradients`).

The gradient norm is the whole model's: the DP slices' squares are summed over DP, TP-sharded parameters' over the
TP group, and replicated ones (layer norms, identical on every TP rank) are counted once.

A checkpoint gathers nothing: each DP rank writes its own slice of the flat moments (`own_slice`), and a load reads
a rank's slice back from them at any DP size (`load_flat_state`), or, when the TP size changed, takes each
parameter's whole moment resharded like the weights (`load_full_state`, one tensor at a time).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's two state tensors, by their torch names
STEP_CHUNK_ELEMENTS = 1 << 20  # 4 MiB of fp32: the largest temporary of a step (and of an exchange over DP)
BUCKET_ELEMENTS = 1 << 22  # 16 MiB of fp32: the gradients of small parameters reduced together
NORM_CHUNK_ELEMENTS = 1 << 20  # 8 MiB of fp64: the gradient norm's temporaries


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
        self.names = [name for name, _ in named_params]
        self.index = {name: index for index, name in enumerate(self.names)}
        self.params = [param for _, param in named_params]
        _check_names(self.names, replicated)
        self.replicated = [name in replicated for name in self.names]
        self.dp_group, self.tp_group = dp_group, tp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
        self.tp_size = dist.get_world_size(tp_group)
        self.device = torch.device(device) if device is not None else self.params[0].device
        not_fp32 = [(name, param.dtype) for name, param in named_params if param.dtype != torch.float32]
        if not_fp32:
            raise ValueError(f"DistributedAdamW steps fp32 parameters in place, and {not_fp32[0][0]!r} is {not_fp32[0][1]}")

        self.offsets = flat_offsets(param.numel() for param in self.params)
        self.numel = self.offsets[-1]
        self.slice_size = -(-self.numel // self.dp_size)  # ceil: the padding sits at the end of the last slice
        start = self.dp_rank * self.slice_size
        self.owned = slice(start, start + self.slice_size)

        self.shard_gradients = shard_gradients and self.dp_size > 1
        self.shard_weights = shard_weights and self.dp_size > 1
        if self.shard_weights and not self.shard_gradients:
            raise ValueError("shard_weights (ZeRO-3) needs shard_gradients: the whole gradients would outweigh the weights")
        # {parameter index: its elements [first, last) that fall in the owned slice}: where its gradient (and, sharded,
        # its weight) goes
        self.owned_parts = {index: (max(lo, start) - lo, min(hi, self.owned.stop) - lo)
                            for index, (lo, hi) in enumerate(zip(self.offsets, self.offsets[1:]))
                            if max(lo, start) < min(hi, self.owned.stop)}
        if self.shard_weights:
            self.units = _unit_ranges(self.names, self.offsets, units)
            self.unit_of = [index for index, (first, last) in enumerate(self.units)
                            for _ in range(first, last)]  # parameter index -> its unit
            self.owned_params = torch.zeros(self.slice_size, dtype=torch.float32, device=self.device)
            for index, param in enumerate(self.params):  # values given (not on the meta device): their owned parts
                if param.device.type != "meta":
                    self.load_weight(self.names[index], param.detach())
            self.unit_buffers = []
            for first, last in self.units:  # each unit's buffer, its storage empty until gathered
                params = self.params[first:last]
                buffer = bind_to_buffer(params, self.offsets[last] - self.offsets[first], self.device)
                buffer.untyped_storage().resize_(0)
                self.unit_buffers.append(buffer)
            self._gathered = [0] * len(self.units)  # how many holders each unit has now
            self._unit_sizes = [self.offsets[last] - self.offsets[first] for first, last in self.units]
        else:
            self.flat_params = bind_to_buffer(self.params, self.slice_size * self.dp_size, self.device)
            self.owned_params = self.flat_params[self.owned]
        # the gradient buffer: the owned slice (sharded), or the whole padded flat space whose `.grad` views backward
        # accumulates into in place, the gradients never copied (at DP size 1 the two are the same)
        self.grad_buffer = torch.zeros(self.slice_size if self.shard_gradients else self.slice_size * self.dp_size,
                                       dtype=torch.float32, device=self.device)
        self.owned_grads = self.grad_buffer if self.shard_gradients else self.grad_buffer[self.owned]
        if self.shard_gradients:
            self._dp_ranks = dist.get_process_group_ranks(dp_group)
            # gradients of parameters smaller than a bucket wait in it, in the order backward gives them, and are
            # all_reduced together when it is full and at the end of every backward: one collective per bucket, not
            # one per parameter (each a point where every replica waits for the others)
            self._bucket = torch.empty(min(bucket_elements, self.numel), dtype=torch.float32, device=self.device)
            self._bucketed: list[tuple[int, int]] = []  # (parameter index, its offset in the bucket)
            self._bucket_filled = 0
            self._arrived = 0  # parameters whose gradient this backward has given: all of them ends it
            for index, param in enumerate(self.params):
                param.register_post_accumulate_grad_hook(self._reduce_hook(index))
        else:
            for param, view in zip(self.params, self._views(self.grad_buffer)):
                param.grad = view  # autograd accumulates into it in place: the gradients are never copied
        # The inner AdamW steps the owned slice of the model's weights itself, cut into chunks: its per-element
        # temporaries (the square root of exp_avg_sq, the update) are one chunk, not the whole slice. The moments are
        # two flat tensors of the slice's size; each chunk's state is a view of them, made before AdamW would make its
        # own. foreach=False: the plain per-element AdamW, the same bits whatever chunk or slice an element falls in.
        self.chunks = [torch.nn.Parameter(view) for view in self.owned_params.split(step_chunk_elements)]
        self.moments = {key: torch.zeros(self.slice_size, dtype=torch.float32, device=self.device) for key in MOMENTS}
        self.optimizer = torch.optim.AdamW(
            self.chunks, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, foreach=False
        )
        self._set_chunk_state(0)

    # --- gradients ---------------------------------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        """Average the gradients over the DP group into the owned slice (a collective, every DP rank calls it). Sharded,
        backward has reduced each parameter's already (the hooks) and what remains is a `.grad` set from outside since;
        whole, one all_reduce of the gradient buffer, in place."""
        if not self.shard_gradients:
            self._grads_in_buffer()
            if self.dp_size > 1:
                dist.all_reduce(self.grad_buffer, group=self.dp_group)
                self.grad_buffer.div_(self.dp_size)
            return
        self._flush_bucket()  # a backward that did not give every parameter its gradient (the same on every replica)
        self._arrived = 0
        set_here = torch.tensor([param.grad is not None for param in self.params], dtype=torch.uint8)
        dist.all_reduce(set_here, op=dist.ReduceOp.MAX, group=self.dp_group)
        for index in set_here.nonzero().flatten().tolist():  # the same list on every DP rank
            param = self.params[index]
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            param.grad = None
            self._reduce_into_slice(index, grad)
        self.owned_grads.div_(self.dp_size)

    def _reduce_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        @torch.no_grad()
        def reduce(param: torch.Tensor) -> None:
            grad, param.grad = param.grad, None
            size = grad.numel()
            if size > self._bucket.numel():
                self._reduce_into_slice(index, grad)  # a large parameter on its own, straight to its owners
            else:
                if self._bucket_filled + size > self._bucket.numel():
                    self._flush_bucket()
                self._bucket[self._bucket_filled : self._bucket_filled + size].copy_(grad.reshape(-1))
                self._bucketed.append((index, self._bucket_filled))
                self._bucket_filled += size
            del grad
            self._arrived += 1
            if self._arrived == len(self.params):  # the end of this backward
                self._flush_bucket()
                self._arrived = 0
        return reduce

    @torch.no_grad()
    def _flush_bucket(self) -> None:
        """Sum the bucket over DP (every replica's holds the same parameters in the same order) and add the owned parts
        of its parameters into the gradient slice."""
        if not self._bucketed:
            return
        filled = self._bucket[: self._bucket_filled]
        dist.all_reduce(filled, group=self.dp_group)
        for index, offset in self._bucketed:
            if index in self.owned_parts:
                first, last = self.owned_parts[index]
                self._owned_grad(index).add_(filled[offset + first : offset + last])
        self._bucketed, self._bucket_filled = [], 0

    def _owned_part(self, index: int, owned: torch.Tensor) -> torch.Tensor:
        """The owned part of parameter `index` in `owned`, a tensor laid out like the owned slice (the gradients, the
        sharded weights): a view."""
        first, last = self.owned_parts[index]
        lo = self.offsets[index] - self.owned.start
        return owned[lo + first : lo + last]

    def _owned_grad(self, index: int) -> torch.Tensor:
        return self._owned_part(index, self.owned_grads)

    @torch.no_grad()
    def _reduce_into_slice(self, index: int, grad: torch.Tensor) -> None:
        """Sum parameter `index`'s gradient over DP onto the ranks owning its elements (one reduce per owner), and add
        this rank's owned part into the gradient slice."""
        flat = grad.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        lo, hi = self.offsets[index], self.offsets[index + 1]
        for owner, first, last in self._owner_parts(lo, hi):
            part = flat[first - lo : last - lo]
            dist.reduce(part, dst=self._dp_ranks[owner], group=self.dp_group)
            if owner == self.dp_rank:
                self._owned_grad(index).add_(part)

    def grad_norm(self) -> float:
        """L2 norm of the whole model's gradient; the same value on every rank (after `reduce_gradients`)."""
        return self._norm()

    def clip_and_step(self, max_norm: float) -> float:
        """Clip the gradient to `max_norm` (clip_grad_norm_'s rule) and take one AdamW step; returns the norm.

        A non-finite norm skips the step (nothing changes, the step count included) on every rank alike.
        """
        norm = self._norm()
        if not math.isfinite(norm):
            return norm
        coef = min(1.0, max_norm / (norm + 1e-6))
        owned = self.owned_grads
        if coef < 1.0:
            owned.mul_(coef)
        for chunk, grad in zip(self.chunks, owned.split(self.chunks[0].numel())):
            chunk.grad = grad
        self.optimizer.step()  # updates this rank's slice of the model's weights in place
        for chunk in self.chunks:
            chunk.grad = None
        if self.dp_size > 1 and not self.shard_weights:  # every replica's slice into every replica's buffer
            self._exchange_slices(self.owned_params, self.flat_params)
        return norm

    def zero_grad(self) -> None:
        """Zero the gradients (whole, every `.grad` stays its view of the buffer; sharded, none is held, and nothing
        waits in the bucket). No collective."""
        self.grad_buffer.zero_()
        if not self.shard_gradients:
            self._grads_in_buffer()
        else:
            for param in self.params:
                param.grad = None
            self._bucketed, self._bucket_filled, self._arrived = [], 0, 0

    @torch.no_grad()
    def _grads_in_buffer(self) -> None:
        """Whole gradients: a `.grad` set from outside (replaced, or set to None) goes back to being its view of the
        gradient buffer, with the value it was given (None: zero)."""
        for param, view in zip(self.params, self._views(self.grad_buffer)):
            if param.grad is None:
                view.zero_()
            elif param.grad.data_ptr() == view.data_ptr():
                continue
            else:
                view.copy_(param.grad)
            param.grad = view

    # --- weights (sharded with `shard_weights`) ------------------------------------------------------------------

    def _owner_parts(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(DP rank, first, last): the elements [first, last) of the flat range [lo, hi) each DP rank owns."""
        return [(owner, max(lo, owner * self.slice_size), min(hi, (owner + 1) * self.slice_size))
                for owner in range(lo // self.slice_size, (hi - 1) // self.slice_size + 1)] if hi > lo else []

    @torch.no_grad()
    def gather(self, unit: int) -> None:
        """Give unit `unit`'s parameters their whole values: each DP rank broadcasts the elements it owns (a collective
        over DP, called by every DP rank in the same order). Nested calls count: the unit stays until as many
        `release`s. Without `shard_weights`, nothing to do."""
        if not self.shard_weights:
            return
        self._gathered[unit] += 1
        if self._gathered[unit] > 1:
            return
        buffer = self.unit_buffers[unit]
        lo = self.offsets[self.units[unit][0]]
        # the parameters are views of the buffer, and autograd may hold them for backward: refilling must not count as
        # an in-place change of what it saved (the values are the same ones, put back)
        with torch.autograd._unsafe_preserve_version_counter(buffer):
            buffer.untyped_storage().resize_(self._unit_sizes[unit] * buffer.element_size())
            for owner, first, last in self._owner_parts(lo, lo + self._unit_sizes[unit]):
                part = buffer[first - lo : last - lo]
                if owner == self.dp_rank:
                    part.copy_(self.owned_params[first - self.owned.start : last - self.owned.start])
                dist.broadcast(part, src=self._dp_ranks[owner], group=self.dp_group)

    def release(self, unit: int) -> None:
        """Drop unit `unit`'s gathered values (its buffer's storage), once every `gather` of it has been released."""
        if not self.shard_weights:
            return
        if self._gathered[unit] <= 0:
            raise RuntimeError(f"weight unit {unit} released more often than gathered")
        self._gathered[unit] -= 1
        if self._gathered[unit] == 0:
            self.unit_buffers[unit].untyped_storage().resize_(0)

    @property
    def num_units(self) -> int:
        return len(self.units) if self.shard_weights else 0

    def unit_of_param(self, name: str) -> int:
        """The unit parameter `name` is gathered with."""
        return self.unit_of[self.index[name]]

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
        elif index in self.owned_parts:
            first, last = self.owned_parts[index]
            self._owned_part(index, self.owned_params).copy_(tensor.reshape(-1)[first:last])

    # --- state ---------------------------------------------------------------------------------------------

    def full_state(self) -> dict[str, Any]:
        """The whole (every DP slice) state of this TP rank, per parameter name, as CPU fp32 tensors of their own
        (views of one flat copy per moment): for tests and tools. Checkpoints never gather it (`own_slice`).

        A collective over the DP group: every DP rank must call it, and every one gets the result.
        """
        result: dict[str, Any] = {"step": self._step_count()}
        for key in MOMENTS:
            full = self.moments[key].clone() if self.dp_size == 1 else self._padded()
            if self.dp_size > 1:
                self._exchange_slices(self.moments[key], full)
            result[key] = dict(zip(self.names, self._views(full.to("cpu"))))
        return result

    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter, in the flat order the moments are sliced in."""
        return [(name, tuple(param.shape)) for name, param in zip(self.names, self.params)]

    def own_slice(self, copy: bool) -> dict[str, Any]:
        """What this DP rank writes to a checkpoint, with no collective: the step count, the elements [start, stop) of
        the flat moments it owns (clipped to the parameters: no padding) and both moments over them, views of the live
        state (a synchronous save writes them before the next step) or, with `copy`, tensors of their own."""
        start, stop = min(self.owned.start, self.numel), min(self.owned.stop, self.numel)
        moments = {key: self.moments[key][: stop - start] for key in MOMENTS}
        if copy:
            moments = {key: tensor.clone() for key, tensor in moments.items()}
        return {"step": self._step_count(), "start": start, "stop": stop, **moments}

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
            differ = next((f"{name!r} {shape} saved as {theirs[name]}" if name in theirs else f"{name!r} is not saved"
                           for name, shape in mine if theirs.get(name) != shape),
                          f"the saved order or an extra parameter ({len(layout)} saved, {len(mine)} here)")
            raise ValueError(f"optimizer state was saved for other parameters: {differ}")
        start, stop = min(self.owned.start, self.numel), min(self.owned.stop, self.numel)
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
        start, stop = self.owned.start, self.owned.stop
        for key in MOMENTS:
            given = state[key]
            loaded: set[str] = set()
            for name, tensor in given.items() if isinstance(given, Mapping) else given:
                index = self.index.get(name)
                if index is None:
                    raise ValueError(f"optimizer state {key} has unknown parameter {name!r}")
                self._check_shape(key, name, tensor, self.params[index])
                lo, hi = self.offsets[index], self.offsets[index + 1]
                first, last = max(lo, start), min(hi, stop)
                if first < last:  # the part of this parameter in this rank's slice
                    self.moments[key][first - start : last - start].copy_(tensor.reshape(-1)[first - lo : last - lo])
                loaded.add(name)
            missing = [name for name in self.names if name not in loaded]
            if missing:
                raise ValueError(f"optimizer state {key} lacks parameter {missing[0]!r}")
            if stop > self.numel:
                self.moments[key][max(self.numel, start) - start :].zero_()  # the padding past the last parameter
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
                raise ValueError(f"optimizer state {key} has shape {got}, this rank's slice is {tuple(tensor.shape)}: "
                                 "not the same layout")
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
            self.optimizer.state[chunk] = {"step": torch.tensor(float(step), dtype=torch.float32),
                                           **{key: views[key][index] for key in MOMENTS}}

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

    # --- flat index space ------------------------------------------------------------------------------------

    def _padded(self) -> torch.Tensor:
        return torch.zeros(self.slice_size * self.dp_size, dtype=torch.float32, device=self.device)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a flat (padded) fp32 tensor, shaped like the parameters."""
        return [flat[lo:hi].view(p.shape) for p, lo, hi in zip(self.params, self.offsets, self.offsets[1:])]

    def _exchange_slices(self, owned: torch.Tensor, out: torch.Tensor) -> None:
        """Every DP rank's `owned` slice into its place in `out` (a padded flat tensor) on every rank (all_gather). One
        chunk at a time: gloo gathers into a buffer of its own and copies out, so a whole-slice call would cost a
        temporary of the whole flat tensor."""
        size = self.chunks[0].numel()
        for lo in range(0, self.slice_size, size):
            hi = min(lo + size, self.slice_size)
            parts = [out[r * self.slice_size + lo : r * self.slice_size + hi] for r in range(self.dp_size)]
            mine = owned[lo:hi].clone()  # `owned` may be a view of `out` itself (the weights)
            dist.all_gather(parts, mine, group=self.dp_group)

    # --- step helpers ----------------------------------------------------------------------------------------

    def _norm(self) -> float:
        """Whole-model L2 norm of the gradient, accumulated in fp64; gathered, never all_reduced: summed in rank order,
        the same bits on every rank run after run."""
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # [TP-sharded, replicated] squares
        if not self.shard_gradients:  # every DP replica holds the whole reduced gradient
            for view, is_replicated in zip(self._views(self.grad_buffer), self.replicated):
                sums[int(is_replicated)] += _square_sum(view)
        else:  # this rank's slice; the DP slices are disjoint, so their squares add up
            for index in self.owned_parts:
                sums[int(self.replicated[index])] += _square_sum(self._owned_grad(index))
            parts = [torch.empty_like(sums) for _ in range(self.dp_size)]
            dist.all_gather(parts, sums, group=self.dp_group)
            sums = torch.stack(parts).sum(0)
        if self.tp_size > 1:
            parts = [torch.empty_like(sums) for _ in range(self.tp_size)]
            dist.all_gather(parts, sums, group=self.tp_group)
            gathered = torch.stack(parts)
            # replicated squares are the same on every TP rank; max (nan-propagating) makes an inf or nan in
            # one rank's copy skip the step on all of them rather than on that rank alone
            sums = torch.stack([gathered[:, 0].sum(), gathered[:, 1].max()])
        return math.sqrt(sums.sum().item())

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
            raise ValueError(f"optimizer state {key}[{name!r}] has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")


def _check_names(names: list[str], replicated: set[str]) -> None:
    if not names:
        raise ValueError("DistributedAdamW needs at least one parameter")
    if len(set(names)) != len(names):
        twice = sorted(n for n in names if names.count(n) > 1)[0]
        raise ValueError(f"DistributedAdamW got the parameter name {twice!r} twice")
    unknown = sorted(set(replicated) - set(names))
    if unknown:
        raise ValueError(f"replicated parameter {unknown[0]!r} is not among the optimizer's parameters")


class UnitCursor:
    """Visits every weight unit of `optimizer` once, in order, gathered one at a time: what a pass over the whole
    weights (a save, a weight sync) does with sharded weights. Every DP rank must make the same visits, so a rank that
    reads nothing still walks them (`finish`), and a rank that stops early (an error) walks the rest in `finish` too,
    instead of leaving its peers waiting in a gather. Without `shard_weights` it gathers nothing."""

    def __init__(self, optimizer: DistributedAdamW):
        self.optimizer = optimizer
        self.current = -1  # the unit gathered now (-1: none yet)

    def tensor(self, name: str) -> torch.Tensor:
        """Parameter `name`, its unit gathered (the units before it visited, the one before released): valid until a
        later unit is asked for or `finish`. Units must be asked for in order."""
        optimizer = self.optimizer
        if not optimizer.shard_weights:
            return optimizer.params[optimizer.index[name]]
        unit = optimizer.unit_of_param(name)
        if unit < self.current:
            raise RuntimeError(f"weight unit {unit} asked for after unit {self.current}: a pass visits them in order")
        self._advance_to(unit)
        return optimizer.params[optimizer.index[name]]

    def _advance_to(self, unit: int) -> None:
        while self.current < unit:
            if self.current >= 0:
                self.optimizer.release(self.current)
            self.current += 1
            self.optimizer.gather(self.current)

    def finish(self) -> None:
        """Visit the units left, and release the last."""
        last = self.optimizer.num_units - 1
        if not self.optimizer.shard_weights or self.current > last:
            return
        self._advance_to(last)
        self.optimizer.release(last)
        self.current = last + 1  # done: nothing is gathered


def _unit_ranges(names: list[str], offsets: list[int], units: Sequence[Sequence[str]] | None) -> list[tuple[int, int]]:
    """[first, last) parameter indices of each unit; ValueError unless the units are consecutive runs of `names`
    covering every one once, in order."""
    if not units:
        raise ValueError("shard_weights needs the units the parameters are gathered in")
    ranges, position = [], 0
    for unit in units:
        unit = list(unit)
        if not unit or names[position : position + len(unit)] != unit:
            raise ValueError(f"weight unit {unit[:2]}... is not the next run of parameters (expected {names[position:position + 1]})")
        ranges.append((position, position + len(unit)))
        position += len(unit)
    if position != len(names):
        raise ValueError(f"the weight units leave out {len(names) - position} parameter(s), e.g. {names[position]!r}")
    return ranges


def _square_sum(tensor: torch.Tensor, chunk: int = NORM_CHUNK_ELEMENTS) -> torch.Tensor:
    """The sum of `tensor`'s squares in fp64, `chunk` elements at a time: its fp64 temporaries are a chunk's, not the
    whole tensor's (two copies of the largest parameter, 100 MB at 600M over tp 2)."""
    total = torch.zeros((), dtype=torch.float64, device=tensor.device)
    for part in tensor.reshape(-1).split(chunk):
        total += part.double().square().sum()
    return total


def flat_offsets(sizes: Iterable[int]) -> list[int]:
    """Start of each tensor of `sizes` elements in a flat concatenation of them, and the total at the end."""
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    return offsets


def _step_of(state: dict[str, Any]) -> int:
    step = state.get("step", 0)
    return int(step.item() if isinstance(step, torch.Tensor) else step)


@torch.no_grad()
def bind_to_buffer(params: list[torch.nn.Parameter], numel: int, device: torch.device | str) -> torch.Tensor:
    """Make each of `params` a view of one zeroed fp32 buffer of `numel` elements (in order, any rest padding), which
    is returned. A parameter with storage keeps its values; one on the meta device gets its storage here (zeros).
    The Parameter objects stay the same (their contents are swapped), so modules and optimizers still hold them."""
    flat = torch.zeros(numel, dtype=torch.float32, device=device)
    offset = 0
    for param in params:
        view = flat[offset : offset + param.numel()].view(param.shape)
        offset += param.numel()
        if param.device.type != "meta":
            view.copy_(param.detach())
        torch.utils.swap_tensors(param, torch.nn.Parameter(view, requires_grad=param.requires_grad))
    if offset > numel:
        raise ValueError(f"{offset} parameter elements do not fit a buffer of {numel}")
    return flat
