"""Reading a ``torch.distributed.checkpoint`` (DCP) directory without running code from it.

torch's ``FileSystemReader`` unpickles the directory's ``.metadata`` with plain
``pickle.load``, and its default planner reads any entry the metadata declares as bytes with
``torch.load(weights_only=False)``: a directory can run code on load, even one whose payload
then yields the real metadata so that the load succeeds. Here:

- ``.metadata`` is unpickled by ``MetadataUnpickler``, which admits DCP's own metadata classes
  and a few plain torch values (``torch.Size``, dtypes, layouts) and nothing callable beyond
  them; anything else is refused by name;
- every storage file the metadata names must be a plain file name inside the directory (no
  ``..``, no absolute path, no link), so a directory cannot make us read elsewhere;
- byte entries are read with ``torch.load(weights_only=True)`` (``SafeLoadPlanner``; our own
  checkpoints hold tensors only, so none is read at all).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from mode.checks import is_file_name

# (module, name) pairs admitted besides the classes defined in DCP's metadata module.
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by its name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),  # the checkpoint id the writer recorded
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
_PLAIN_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeMetadataError(pickle.UnpicklingError):
    """``.metadata`` names something other than DCP's metadata classes and plain values."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, admitting only the globals it is made of."""

    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__:
            obj = getattr(dcp_metadata, name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), _PLAIN_TORCH_VALUES):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise UnsafeMetadataError(f"it names {module}.{name}, which is not part of a checkpoint's metadata")


def read_metadata(path: str | Path) -> Metadata:
    """The ``Metadata`` of the DCP directory ``path``, read with ``MetadataUnpickler`` and
    checked: it is a ``Metadata`` and every storage file it names is a plain file of ``path``.
    ``UnsafeMetadataError`` (a ``pickle.UnpicklingError``) otherwise."""
    path = Path(path)
    with open(path / ".metadata", "rb") as f:
        metadata = MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeMetadataError(f"it holds a {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        name = info.relative_path if isinstance(info, _StorageInfo) else None
        if not is_file_name(name):
            raise UnsafeMetadataError(f"it names the storage file {name!r}, which is not a file name in {path}")
        if (path / name).is_symlink():
            raise UnsafeMetadataError(f"its storage file {name} is a symbolic link")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by ``read_metadata`` (no code runs)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads byte entries with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
