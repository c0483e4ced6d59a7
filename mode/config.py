"""Configs: a tree of small dataclasses used as omegaconf structured configs.

Entry point: ``load_config(preset_or_path, overrides)`` does
``OmegaConf.merge(structured(Config), yaml, cli_dotlist)`` and then ``to_object``, which
runs every dataclass' ``__post_init__`` validation. Invalid values raise ``ValueError``
naming the field, the value and what is allowed.

Only primitives live here (no devices, no process groups): runtime objects are passed
to the builders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mode.checks import ConfigError, check_choice, check_positive, check_range, closest, fail
from mode.experts.moe import MoEConfig
from mode.layers.arch import Arch
from mode.layers.attention import ATTENTION_BACKENDS
from mode.layers.early_exit import EarlyExitConfig
from mode.layers.kinds import BLOCK_KINDS, any_kind
from mode.layers.mod import RoutingConfig
from mode.layers.recompute import ACTIVATION_CHECKPOINTS
from mode.loggers import LOGGERS
from mode.precision import PRECISIONS

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "EarlyExitConfig",
    "ModelConfig",
    "MoEConfig",
    "ParallelConfig",
    "RoutingConfig",
    "TrainConfig",
    "from_dict",
    "load_config",
    "preset_names",
    "to_dict",
    "to_yaml",
]


class UnknownPresetError(FileNotFoundError, ValueError):
    """``load_config`` got a name that is neither a preset nor a YAML file."""


# The presets ship inside the package, so they load from a plain (non-editable) install.
PRESETS = resources.files("mode") / "configs"


@dataclass
class ModelConfig:
    """Decoder-only LM. ``layout`` is a comma/space separated pattern of block kinds tiled to
    ``n_layers`` (e.g. "dense,mod" = MoD every other block), or a full per-layer list.
    ``attention``: "sdpa" (default, any device) or "xformers" (CUDA; ``mode.layers.attention``).

    The architecture options (``mode.layers.arch``, the same in every block kind): ``norm``
    "layernorm" | "rmsnorm" with ``norm_eps``; ``mlp`` "gelu" | "gelu_tanh" | "swiglu", the
    dense MLP, ``d_ff`` wide (0: ``mlp_ratio * d_model``); ``n_kv_heads`` key/value heads
    (grouped-query attention; 0: ``n_heads``); ``bias`` on every linear and norm (GPT-2),
    ``qkv_bias`` on the query/key/value projection only (Qwen2); ``positions`` "rope" (at
    ``rope_base``) | "learned" (a position embedding added to the token embedding); ``qk_norm``
    RMSNorm on the projected queries and keys (OLMoE);
    ``tie_embeddings``: the LM head is the token embedding."""

    vocab_size: int = 256
    seq_len: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    layout: str = "dense,mod"
    tie_embeddings: bool = True
    rope_base: float = 10000.0
    attention: str = "sdpa"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    mlp: str = "gelu"
    d_ff: int = 0
    n_kv_heads: int = 0
    bias: bool = False
    qkv_bias: bool = False
    positions: str = "rope"
    qk_norm: bool = False
    mod: RoutingConfig = field(default_factory=RoutingConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    early_exit: EarlyExitConfig = field(default_factory=EarlyExitConfig)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            check_positive(f"model.{name}", getattr(self, name))
        if self.d_model % self.n_heads:
            fail("model.d_model", self.d_model, f"must be divisible by n_heads={self.n_heads}")
        check_positive("model.n_kv_heads", self.n_kv_heads, allow_zero=True)  # 0: one per query head
        arch = self.arch()  # validates the architecture options (``Arch``, errors name model.<field>)
        if arch.rope and (self.d_model // self.n_heads) % 2:
            fail("model.n_heads", self.n_heads, "head dim d_model/n_heads must be even for RoPE")
        arch.kv_heads(self.n_heads, field_prefix="model.")
        check_choice("model.attention", self.attention, ATTENTION_BACKENDS)
        check_positive("model.d_ff", self.d_ff, allow_zero=True)
        kinds = self.block_kinds()  # validates the layout
        if self.early_exit.enabled:
            self.early_exit.check_depth(self.n_layers)
            if set(kinds) != {"dense"}:
                fail(
                    "model.early_exit.enabled",
                    True,
                    f"early exit runs on dense blocks only and model.layout={self.layout!r} has "
                    f"{sorted(set(kinds) - {'dense'})}: use layout 'dense'",
                )
        if self.moe.n_noop and not any_kind(kinds, "has_noop_experts"):
            with_noop = [k for k, kind in BLOCK_KINDS.items() if kind.has_noop_experts]
            fail(
                "model.moe.n_noop",
                self.moe.n_noop,
                f"only {with_noop} blocks have no-op experts and model.layout={self.layout!r} has none: "
                "set it to 0 or add one to the layout",
            )

    def arch(self) -> Arch:
        """The block architecture these options describe (``mode.layers.arch``)."""
        return Arch(
            norm=self.norm,
            norm_eps=self.norm_eps,
            mlp=self.mlp,
            n_kv_heads=self.n_kv_heads or None,
            bias=self.bias,
            qkv_bias=self.qkv_bias,
            positions=self.positions,
            rope_base=self.rope_base,
            qk_norm=self.qk_norm,
            field_prefix="model.",
        )

    def dense_d_ff(self) -> int:
        """The dense MLP's hidden width: ``d_ff``, or ``mlp_ratio * d_model``."""
        return self.d_ff or self.mlp_ratio * self.d_model

    def expert_d_ff(self) -> int:
        """Per-expert hidden size: ``moe.d_ff``, or ``mlp_ratio * d_model // top_k`` so that a
        token's active expert FLOPs match the dense MLP."""
        return self.moe.width(self.d_model, self.mlp_ratio)

    def block_kinds(self) -> list[str]:
        """The per-layer block kinds, the layout pattern tiled to n_layers."""
        pattern = [p for p in self.layout.replace(",", " ").split() if p]
        if not pattern:
            fail("model.layout", self.layout, f"give a pattern of {list(BLOCK_KINDS)}")
        for p in pattern:
            if p not in BLOCK_KINDS:
                hint = closest(p, BLOCK_KINDS)
                fail("model.layout", self.layout, f"{p!r} is not a block kind: choose from {list(BLOCK_KINDS)}{hint}")
        if self.n_layers % len(pattern):
            fail("model.layout", self.layout, f"pattern length must divide n_layers={self.n_layers}")
        return pattern * (self.n_layers // len(pattern))


@dataclass
class DataConfig:
    """source: "shakespeare" (embedded corpus, fetched and cached on first use), a text file,
    token files (``.bin`` uint16 / ``.u32`` uint32 memmaps, llm.c shards, or a glob of them),
    or a directory ``mode-prepare`` wrote (``mode.data``). tokenizer: what encodes a text
    source, "bytes" or a ``tokenizer.json`` / a directory holding one (``mode.tokenizer``)."""

    source: str = "shakespeare"
    cache_dir: str = "data"
    val_fraction: float = 0.05
    tokenizer: str = "bytes"

    def __post_init__(self) -> None:
        check_range("data.val_fraction", self.val_fraction, 0.0, 0.5, lo_open=True)


SWITCHES = ("auto", "true", "false")


@dataclass
class TrainConfig:
    steps: int = 200
    max_seconds: float = 0.0  # training wall-clock budget (steps + data, not eval); 0 = no limit
    batch_size: int = 16
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 8
    log_every: int = 10
    ckpt_every: int = 0  # 0 = only at the end
    keep_checkpoints: int = 1  # > 1: also keep the N - 1 checkpoints before the latest (<ckpt>.step<N>)
    out_dir: str = "runs/default"
    resume: bool = False
    overwrite: bool = False  # replace an earlier run in out_dir (its checkpoints and logs); else refused
    seed: int = 1337
    device: str = "auto"  # auto (cuda when available, else cpu) | cpu | cuda | cuda:N
    precision: str = "fp32"  # fp32 | bf16 (autocast, fp32 weights) | auto (bf16 where faster): mode.precision
    max_bad_steps: int = 3  # consecutive non-finite steps (skipped) before training stops
    grad_accum_steps: int = 1  # micro-batches per optimizer step (batch_size / world split into them)
    activation_checkpoint: str = "none"  # none | full | every_n (mode.layers.recompute)
    activation_checkpoint_every: int = 2  # every_n: checkpoint blocks 0, n, 2n, ...
    compile: str = "false"  # true | false | auto (on CUDA): torch.compile each block (mode.compile)
    fused_optimizer: str = "auto"  # auto (fused AdamW where torch has it) | true | false (foreach)
    profile_steps: list[int] = field(default_factory=list)  # [first, last]: torch.profiler trace to out_dir
    init_from: str = ""  # a dense checkpoint to convert into this model (mode.convert.upcycle); fresh optimizer
    threads: int = 0  # torch.set_num_threads; 0 = leave the default
    progress: bool = True
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])  # + tensorboard, wandb (mode.loggers)

    def __post_init__(self) -> None:
        check_positive("train.steps", self.steps)
        check_positive("train.max_seconds", self.max_seconds, allow_zero=True)
        check_positive("train.batch_size", self.batch_size)
        check_positive("train.lr", self.lr)
        check_positive("train.min_lr", self.min_lr, allow_zero=True)
        if self.min_lr > self.lr:
            fail("train.min_lr", self.min_lr, f"must be <= train.lr={self.lr}")
        check_positive("train.warmup_steps", self.warmup_steps, allow_zero=True)
        check_positive("train.weight_decay", self.weight_decay, allow_zero=True)
        check_positive("train.grad_clip", self.grad_clip, allow_zero=True)
        check_positive("train.eval_every", self.eval_every)
        check_positive("train.eval_batches", self.eval_batches)
        check_positive("train.log_every", self.log_every)
        check_positive("train.ckpt_every", self.ckpt_every, allow_zero=True)
        check_positive("train.max_bad_steps", self.max_bad_steps)
        check_positive("train.keep_checkpoints", self.keep_checkpoints)
        if self.resume and self.overwrite:
            fail("train.overwrite", self.overwrite, "contradicts train.resume=true: continue the run or replace it")
        check_choice("train.precision", self.precision, PRECISIONS)
        check_positive("train.grad_accum_steps", self.grad_accum_steps)
        if self.batch_size % self.grad_accum_steps:
            fail("train.grad_accum_steps", self.grad_accum_steps, f"must divide train.batch_size={self.batch_size}")
        check_choice("train.activation_checkpoint", self.activation_checkpoint, ACTIVATION_CHECKPOINTS)
        for logger in self.loggers:
            check_choice("train.loggers", logger, LOGGERS)
        # NOTE: YAML and dotlist booleans reach these str fields as "True"/"False".
        self.compile = str(self.compile).lower()
        check_choice("train.compile", self.compile, SWITCHES)
        self.fused_optimizer = str(self.fused_optimizer).lower()
        check_choice("train.fused_optimizer", self.fused_optimizer, SWITCHES)
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError as e:
                fail("train.device", self.device, f"is not a device ({e}): use auto, cpu, cuda or cuda:N")
        check_positive("train.activation_checkpoint_every", self.activation_checkpoint_every)
        if self.profile_steps and (
            len(self.profile_steps) != 2 or not 1 <= self.profile_steps[0] <= self.profile_steps[1]
        ):
            fail("train.profile_steps", list(self.profile_steps), "must be [first, last] with 1 <= first <= last")


@dataclass
class ParallelConfig:
    dp_size: int = 1
    ep_size: int = 1
    # A collective that waits longer than this (a rank died or hangs) fails on every other
    # rank, naming the timeout, instead of waiting torch's default 10-30 minutes.
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        check_positive("parallel.dp_size", self.dp_size)
        check_positive("parallel.ep_size", self.ep_size)
        check_positive("parallel.timeout_s", self.timeout_s)


@dataclass
class Config:
    name: str = "default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        # Only a layout with experts splits them over "ep"; for one without, ep ranks are data
        # parallel and moe.n_experts is unused.
        if self.parallel.ep_size > 1 and any_kind(self.model.block_kinds(), "holds_experts"):
            if self.model.moe.n_experts % self.parallel.ep_size:
                fail(
                    "parallel.ep_size",
                    self.parallel.ep_size,
                    f"model.moe.n_experts={self.model.moe.n_experts} must be divisible by it",
                )


def preset_names() -> list[str]:
    """Names of the YAML presets shipped in the package (``mode/configs``)."""
    return sorted(p.name.removesuffix(".yaml") for p in PRESETS.iterdir() if p.name.endswith(".yaml"))


def _resolve(preset: str | Path) -> tuple[str, str]:
    """(name, YAML text) of a preset name or a YAML path."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return str(path.resolve()), path.read_text()
    candidate = PRESETS / f"{preset}.yaml"
    if candidate.is_file():
        return str(preset), candidate.read_text()
    names = preset_names()
    raise UnknownPresetError(f"no config {str(preset)!r}: give a YAML path or one of {names}{closest(preset, names)}")


def _preset_layers(preset: str | Path, seen: tuple[str, ...] = ()) -> list:
    """A preset's YAML, preceded by the presets it names under ``base:`` (recursively)."""
    name, text = _resolve(preset)
    if name in seen:
        raise ValueError(f"base: presets form a cycle through {name}")
    try:
        # NOTE: omegaconf reads YAML with a safe loader: tags that would build Python objects
        # (``!!python/object/apply:...``) are refused, not run.
        node = OmegaConf.create(text)
    except yaml.YAMLError as e:
        raise ValueError(f"config {name} is not plain YAML: {str(e).splitlines()[0]}") from e
    base = node.pop("base", None)
    return ([*_preset_layers(base, (*seen, name))] if base else []) + [node]


def load_config(preset: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build a validated ``Config`` from defaults, a preset (name in ``configs/`` or a YAML
    path; a preset may start from another with ``base: <name>``) and CLI dotlist overrides
    such as ``["model.n_layers=8"]``."""
    layers = []
    if preset is not None:
        layers.extend(_preset_layers(preset))
    if overrides:
        for item in overrides:
            if "=" not in item:
                hint = f"; {item!r} is a preset: give it as the preset (mode-train --config {item})"
                raise ConfigError(
                    f"override {item!r} has no '=': write field=value (e.g. model.n_layers=8)"
                    + (hint if item in preset_names() else "")
                )
        layers.append(OmegaConf.from_dotlist(list(overrides)))
    return _build(layers)


def from_dict(values: dict) -> Config:
    """A validated ``Config`` from nested values, e.g. ``to_dict`` of one saved in a checkpoint.
    The values are data, not templates: a string holding an omegaconf interpolation (``${...}``,
    which could read the environment) is refused by field, unresolved."""
    if not isinstance(values, dict):
        raise ConfigError(f"a config must be a mapping of fields, not a {type(values).__name__}")
    _refuse_interpolation(values, "")
    return _build([OmegaConf.create(values)])


def _refuse_interpolation(value: object, key: str) -> None:
    """``ConfigError`` naming the first field of ``value`` (nested dicts and lists) whose
    string holds ``${`` (an ``OmegaConf`` interpolation); a saved config never has one (its
    values were resolved when it was written)."""
    if isinstance(value, dict):
        for k, v in value.items():
            _refuse_interpolation(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _refuse_interpolation(v, f"{key}[{i}]")
    elif isinstance(value, str) and "${" in value:
        raise ConfigError(
            f"{key or 'config'} holds an interpolation ('${{...}}'): a config read from a file is data, and "
            "interpolations are not resolved (they could read the environment); write the value itself"
        )


def _build(layers: list) -> Config:
    """Merge config layers over the defaults and validate; errors name the field."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), *layers)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        cause = err.__cause__ or err.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        key = getattr(err, "full_key", None) or "config"
        # omegaconf's message already names the closest field for a misspelt key
        raise ValueError(f"{key}: {str(err).splitlines()[0]}") from None


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))  # type: ignore[return-value]
