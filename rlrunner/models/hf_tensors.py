"""The initial weights of a model, read by HF name one slice at a time, so that a rank builds only its own part.

Three places they come from, behind one interface (`HFTensors.read(name, dim, start, stop)`):

* `SeededInit`: the embedded random initialisation. Each tensor is generated in fixed blocks of rows, each block
  from a seed derived from (run seed, tensor name, block index), so a tensor's values depend on neither the world
  size nor the backend, and a rank generates only the blocks its rows fall in (every block, one at a time, for a
  column slice). The distributions are HF's (`PreTrainedModel._init_weights`): linear and embedding weights
  normal(0, initializer_range), biases zero, the padding row zero, norm weights one.
* `SafetensorsFolder`: an HF folder's `*.safetensors`, read with safetensors' slices (only the rows or columns
  asked for leave the file).
* `StateDict`: tensors already in memory (a `pytorch_model*.bin` folder memory-mapped, or a training checkpoint's
  weights read whole).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Mapping

import torch

from rlrunner.errors import ConfigError

BLOCK_ELEMENTS = 1 << 20  # one generated block: 4 MiB of float32, whatever the tensor's size


class HFTensors(ABC):
    """The full tensors of an HF model by state-dict name, read in slices."""

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of tensor `name`; KeyError naming it when there is no such tensor."""

    @abstractmethod
    def _read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices [start, stop) along `dim` (0 or 1) of tensor `name`."""

    def read(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Indices [start, stop) of tensor `name` along `dim` (all of it by default), as a tensor of its own storage,
        in the dtype it is kept in."""
        shape = self.shape(name)
        size = shape[dim] if shape else 1
        stop = size if stop is None else stop
        if not 0 <= start <= stop <= size:
            raise ValueError(f"{name}: indices {start}:{stop} of dim {dim} are outside its shape {shape}")
        if dim not in (0, 1) or dim >= max(len(shape), 1):
            raise ValueError(f"{name}: only dim 0 or 1 can be sliced, not dim {dim} of shape {shape}")
        return self._read(name, dim, start, stop)


class StateDict(HFTensors):
    def __init__(self, state: Mapping[str, torch.Tensor], aliases: Mapping[str, str] | None = None):
        self.state, self.aliases = state, dict(aliases or {})

    def _tensor(self, name: str) -> torch.Tensor:
        return self.state[self.aliases.get(name, name) if name not in self.state else name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensor(name).shape)

    def _read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        tensor = self._tensor(name)
        return (tensor.narrow(dim, start, stop - start) if tensor.dim() else tensor).clone()


def tied_aliases(config: Any) -> dict[str, str]:
    """A tied output layer is the embedding: folders and checkpoints may omit it."""
    return {"lm_head.weight": "model.embed_tokens.weight"} if getattr(config, "tie_word_embeddings", False) else {}


class SafetensorsFolder(HFTensors):
    """The `*.safetensors` files of an HF folder (one file or the shards of an index): each read opens the file
    holding the tensor and takes only the asked slice."""

    def __init__(self, folder: str | Path, config: Any):
        from safetensors import safe_open

        self.files: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in sorted(Path(folder).expanduser().glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    self.files[key] = path
                    self.shapes[key] = tuple(handle.get_slice(key).get_shape())
        if not self.files:
            raise ConfigError(f"model.path has no *.safetensors weights: {folder}")
        self.aliases = {k: v for k, v in tied_aliases(config).items() if k not in self.files}

    def _key(self, name: str) -> str:
        key = self.aliases.get(name, name)
        if key not in self.files:
            raise KeyError(f"the model folder has no tensor {name!r}")
        return key

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[self._key(name)]

    def _read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        from safetensors import safe_open

        key = self._key(name)
        with safe_open(str(self.files[key]), framework="pt") as handle:
            part = handle.get_slice(key)
            if not self.shapes[key]:
                return part[:]
            return (part[start:stop] if dim == 0 else part[:, start:stop]).contiguous()


def _block_seed(seed: int, name: str, block: int) -> int:
    # blake2b, not utils.seeding.derive_seed: these values are the initial weights every test and figure since
    # issue 18 was measured from (the seed derivation is the weights)
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # a non-negative int64


class SeededInit(HFTensors):
    """HF's random initialisation of `model`'s parameters (a model on the meta device is enough: only names, shapes
    and module types are read), generated block by block from `seed`."""

    def __init__(self, model: torch.nn.Module, config: Any, seed: int):
        self.seed = int(seed)
        self.std = float(getattr(config, "initializer_range", None) or 0.02)
        self.rules: dict[str, tuple[tuple[int, ...], str, int | None]] = {}  # name -> (shape, fill, zero row)
        for module_name, module in model.named_modules():
            kind = type(module).__name__
            for attr, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{attr}" if module_name else attr
                if name in self.rules:
                    continue
                zero_row = None
                if isinstance(module, torch.nn.Linear):
                    fill = "normal" if attr == "weight" else "zeros"
                elif isinstance(module, torch.nn.Embedding):
                    fill, zero_row = "normal", module.padding_idx
                elif "LayerNorm" in kind or "RMSNorm" in kind:
                    fill = "ones" if attr == "weight" else "zeros"
                else:
                    raise NotImplementedError(f"no random initialisation rule for {name} (a parameter of {kind})")
                self.rules[name] = (tuple(param.shape), fill, zero_row)
        tied = {}
        for name, param in model.state_dict(keep_vars=True).items():  # a tied weight: the name it is first listed under
            tied.setdefault(id(param), name)
        self.aliases = {
            name: tied[id(param)]
            for name, param in model.state_dict(keep_vars=True).items()
            if tied[id(param)] != name and tied[id(param)] in self.rules
        }

    def _rule(self, name: str) -> tuple[str, tuple[tuple[int, ...], str, int | None]]:
        key = self.aliases.get(name, name)
        if key not in self.rules:
            raise KeyError(f"the model has no parameter {name!r}")
        return key, self.rules[key]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._rule(name)[1][0]

    def _read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        key, (shape, fill, zero_row) = self._rule(name)
        if fill != "normal":
            sliced = list(shape)
            if shape:
                sliced[dim] = stop - start
            return (torch.ones if fill == "ones" else torch.zeros)(sliced, dtype=torch.float32)
        rows, tail = shape[0], shape[1:]
        row_numel = max(1, torch.Size(tail).numel())
        block_rows = max(1, BLOCK_ELEMENTS // row_numel)
        first_row, last_row = (start, stop) if dim == 0 else (0, rows)
        pieces = []
        for block in range(first_row // block_rows, -(-last_row // block_rows)):
            lo, hi = block * block_rows, min((block + 1) * block_rows, rows)
            values = torch.empty((hi - lo, *tail), dtype=torch.float32)
            values.normal_(0.0, self.std, generator=torch.Generator().manual_seed(_block_seed(self.seed, key, block)))
            if zero_row is not None and lo <= zero_row < hi:
                values[zero_row - lo] = 0.0
            take = values[max(first_row, lo) - lo : min(last_row, hi) - lo]
            pieces.append(take if dim == 0 else take[:, start:stop].clone())
        if not pieces:
            return torch.empty((0, *tail) if dim == 0 else (rows, stop - start, *tail[1:]), dtype=torch.float32)
        return torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0].clone()
