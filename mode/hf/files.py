"""The files of a Hugging Face checkpoint directory, read and written without any family's
knowledge: ``config.json``, ``model.safetensors`` or its shards, and the checkpoint's tensors
taken one by one (``Tensors``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mode.checks import is_file_name, read_json_object

StateDict = dict[str, torch.Tensor]


class UnsupportedCheckpoint(ValueError):
    """A Hugging Face checkpoint or a model that the conversion cannot map exactly; the
    message names every field at fault."""


def refuse(where: str, problems: list[str]) -> None:
    """``UnsupportedCheckpoint`` listing ``problems`` (none: nothing happens)."""
    if problems:
        raise UnsupportedCheckpoint(f"{where} cannot be converted exactly:\n  - " + "\n  - ".join(problems))


def hf_config(path: str | Path) -> dict:
    """``config.json`` of a checkpoint directory as a dict."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {path}: expected a Hugging Face checkpoint directory")
    return read_json_object(file, "write it again with save_pretrained", UnsupportedCheckpoint)


def read_hf_state(path: str | Path) -> StateDict:
    """Every tensor of a checkpoint directory: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` lists."""
    from safetensors.torch import load_file  # noqa: PLC0415  (the hf extra)

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = index_shards(index)
        if (path / "model.safetensors").is_file() and shards != ["model.safetensors"]:
            raise UnsupportedCheckpoint(
                f"{path} holds both model.safetensors and {index.name} (listing {', '.join(shards[:3])}"
                f"{', ...' if len(shards) > 3 else ''}): which is the model is ambiguous (a stale export?); "
                "remove the one that is not"
            )
    elif (path / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        found = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        raise FileNotFoundError(
            f"no model.safetensors or model.safetensors.index.json in {path} (found {found}): "
            "save the model with safe_serialization (transformers' default)"
        )
    state: StateDict = {}
    for shard in shards:
        if not (path / shard).is_file():
            raise FileNotFoundError(f"{path / shard} is missing (the index lists it): copy the whole model directory")
        try:
            state.update(load_file(path / shard))
        except Exception as e:  # noqa: BLE001  (safetensors raises its own SafetensorError, OSError, ...)
            raise UnsupportedCheckpoint(f"{path / shard} is not a readable safetensors file: {e}") from e
    return state


def index_shards(index: Path) -> list[str]:
    """The shard files a ``model.safetensors.index.json`` lists, sorted: plain file names in
    its directory only (``UnsupportedCheckpoint`` naming the entry otherwise)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise UnsupportedCheckpoint(f"{index} is not a safetensors index (no weight_map of names): {e!r}") from e
    for name in names:
        if not is_file_name(name):
            raise UnsupportedCheckpoint(f"{index} lists the shard {name!r}: only file names inside its directory")
    return names


def remove_stale_export(path: Path) -> None:
    """Remove an earlier export's sharded weights from ``path``: its index and the shards it
    lists (a later reader would prefer them to the new ``model.safetensors``)."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return
    for name in index_shards(index):
        (path / name).unlink(missing_ok=True)
    index.unlink()


class Tensors:
    """A checkpoint's tensors, taken one by one under their names inside the model's
    ``prefix`` (``model.`` / ``transformer.``; the head sits outside it); errors name the
    checkpoint's own keys."""

    IGNORED = ("attn.bias", "attn.masked_bias", "rotary_emb.inv_freq")  # buffers, not weights

    def __init__(self, state: StateDict, prefix: str) -> None:
        self.state, self.prefix = dict(state), prefix

    def _key(self, name: str) -> str:
        inside = self.prefix + name
        return inside if inside in self.state or name not in self.state else name

    def take(self, name: str) -> torch.Tensor:
        key = self._key(name)
        if key not in self.state:
            raise UnsupportedCheckpoint(f"the checkpoint has no tensor {self.prefix + name!r}")
        return self.state.pop(key)

    def take_optional(self, name: str) -> torch.Tensor | None:
        return self.state.pop(self._key(name), None)

    def has(self, name: str) -> bool:
        return self._key(name) in self.state

    def check_all_taken(self) -> None:
        rest = sorted(k for k in self.state if not k.endswith(self.IGNORED))
        refuse("the checkpoint", [f"checkpoint tensors with no place here: {rest}"] if rest else [])
