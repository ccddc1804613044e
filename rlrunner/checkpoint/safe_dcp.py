"""Reading torch.distributed.checkpoint folders without running arbitrary pickles.

Stock DCP reads `.metadata` with `pickle.load` and every non-tensor item with
`torch.load` with weights_only off: a crafted checkpoint could run code on load. Here `.metadata`
goes through an unpickler that admits only DCP's metadata classes and torch's dtype, Size and
layout, and items go through `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

METADATA_FILE = ".metadata"

_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeMetadataError(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeMetadataError(f"checkpoint metadata refers to {module}.{name}, which a DCP .metadata never needs")


def read_metadata(dcp_dir: str | Path) -> Metadata:
    """The DCP `.metadata` of a folder, through the restricted unpickler."""
    with open(Path(dcp_dir) / METADATA_FILE, "rb") as handle:
        metadata = _MetadataUnpickler(handle).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeMetadataError("checkpoint .metadata does not hold DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, with non-tensor items read by `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def saved_keys(dcp_dir: str | Path) -> list[str]:
    """The flattened keys (e.g. "model.lm_head.weight") stored in a DCP folder."""
    return sorted(read_metadata(dcp_dir).state_dict_metadata)
