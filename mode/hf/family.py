"""The protocol a Hugging Face family's adapter implements (as torchtitan's
``StateDictAdapter``): its ``config.json`` and its state dict, each both ways, and which models
it holds on export. ``mode.hf.registry`` lists the adapters; ``mode.hf.convert`` drives them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from mode.config import ModelConfig
from mode.hf.files import StateDict, Tensors


class Family(Protocol):
    """One ``model_type``: ``name`` (config.json's ``model_type``), ``architecture`` (the
    transformers class ``to_hf`` writes; None: read only), ``prefix`` (where its model's
    tensors sit: ``model.`` / ``transformer.``), ``sizes`` (the config fields that must be
    positive ints), ``moe`` (its blocks hold experts) and ``mixed_layouts`` (its models may mix
    dense and MoE blocks: Qwen2-MoE's ``mlp_only_layers``)."""

    name: str
    architecture: str | None
    prefix: str
    sizes: tuple[str, ...]
    moe: bool
    mixed_layouts: bool

    def config_in(self, c: dict, problems: list[str]) -> dict:
        """The ``model`` section of a ``ModelConfig`` for ``config.json`` ``c``; appends to
        ``problems`` every field it cannot represent."""
        ...

    def state_in(self, state: Tensors, cfg: ModelConfig) -> StateDict:
        """The checkpoint's tensors (taken from ``state``) as this library's names and layouts."""
        ...

    def holds(self, cfg: ModelConfig) -> bool:
        """Whether an exported model of ``cfg`` is this family's (the registry's first that says so)."""
        ...

    def export_problems(self, cfg: ModelConfig) -> list[str]:
        """Every field of ``cfg`` (held by this family) that the family cannot represent."""
        ...

    def config_out(self, cfg: ModelConfig, dtype: torch.dtype) -> dict:
        """The family's ``config.json`` of ``cfg`` (weights in ``dtype``)."""
        ...

    def state_out(self, state: StateDict, cfg: ModelConfig) -> StateDict:
        """This library's state dict as the family's names and layouts."""
        ...


def common_config_out(cfg: ModelConfig, family: Family, dtype: torch.dtype) -> dict:
    """The fields every family's ``config.json`` starts with."""
    return {
        "model_type": family.name,
        "vocab_size": cfg.vocab_size,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "tie_word_embeddings": cfg.tie_embeddings,
        "architectures": [family.architecture],
    }
