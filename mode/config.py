"""Configs: a tree of small dataclasses used as omegaconf structured configs.

Entry point: ``load_config(preset_or_path, overrides)`` does
``OmegaConf.merge(structured(Config), yaml, cli_dotlist)`` and then ``to_object``, which
runs every dataclass' ``__post_init__`` validation. Invalid values raise ``ValueError``
naming the field, the value and what is allowed.

Only primitives live here (no devices, no process groups): runtime objects are passed
to the builders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

BLOCK_KINDS = ("dense", "mod", "moe", "moe_capacity", "mode_staged", "mode_integrated")
GATES = ("sigmoid", "identity", "none")
CAUSAL_METHODS = ("none", "router_bce", "predictor")
MLP_KINDS = ("gelu", "swiglu")
DROP_POLICIES = ("position", "probs")
MOE_ROUTERS = ("token_choice", "expert_choice")
LB_SCOPES = ("batch", "sequence")


class ConfigError(ValueError):
    """An invalid config value; the message names the field, the value and what is allowed."""


def _fail(name: str, value: object, allowed: str) -> None:
    raise ConfigError(f"{name}={value!r} is invalid: {allowed}")


def _check_range(name: str, value: float, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = (value > lo if lo_open else value >= lo) and value <= hi
    if not ok or (isinstance(value, float) and math.isnan(value)):
        bracket = "(" if lo_open else "["
        _fail(name, value, f"must be in {bracket}{lo}, {hi}]")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(name, value, f"choose one of {list(choices)}")


def _check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        _fail(name, value, "must be >= 0" if allow_zero else "must be > 0")


@dataclass
class RoutingConfig:
    """Mixture-of-Depths routing around a block (expert choice over the sequence).

    capacity: share of each sequence's tokens that go through a routed block, k = floor(capacity*T).
    gate: g(r) in ``x + g(r) * f(x)``; "sigmoid" (default), "identity" (the paper), "none" (g = 1:
        no router gradient; for ablations and equivalence tests).
    causal: how a token decides alone at sampling time: "router_bce" trains the router logit
        toward top-k membership, "predictor" applies the top-k rule to the tokens so far (the
        detached router score against the k-th largest score of the prefix), corrected by a
        small MLP on ``x.detach()`` trained by BCE (``mode.layers.predictor``).
    """

    capacity: float = 0.125
    gate: str = "sigmoid"
    causal: str = "none"
    causal_coef: float = 0.01
    predictor_hidden: int = 64

    def __post_init__(self) -> None:
        _check_range("model.mod.capacity", self.capacity, 0.0, 1.0)
        _check_choice("model.mod.gate", self.gate, GATES)
        _check_choice("model.mod.causal", self.causal, CAUSAL_METHODS)
        _check_positive("model.mod.causal_coef", self.causal_coef, allow_zero=True)
        _check_positive("model.mod.predictor_hidden", self.predictor_hidden)


@dataclass
class MoEConfig:
    """Experts in the MLP: routing, capacity, losses, backend.

    d_ff: hidden size of each expert; 0 means ``mlp_ratio * d_model // top_k`` so that the
        active FLOPs per token match the dense MLP.
    n_noop: no-op experts of the integrated MoDE block (output zero, cost nothing).
    noop_share: target share of assignments to the no-op experts in the load-balance loss.
    bias_rate: aux-loss-free balancing (per-expert selection bias) update rate; 0 disables it.
    """

    n_experts: int = 8
    top_k: int = 2
    d_ff: int = 0
    mlp: str = "gelu"
    backend: str = "auto"
    router: str = "token_choice"
    renormalize: bool = True
    jitter: float = 0.0
    capacity_factor: float = 1.25
    drop_policy: str = "position"
    shared_expert: bool = False
    n_noop: int = 0
    noop_share: float = 0.5
    lb_coef: float = 0.01
    lb_scope: str = "batch"
    z_coef: float = 0.001
    bias_rate: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("model.moe.n_experts", self.n_experts)
        if not 1 <= self.top_k <= self.n_experts + self.n_noop:
            _fail("model.moe.top_k", self.top_k, f"must be in [1, n_experts + n_noop = {self.n_experts + self.n_noop}]")
        _check_positive("model.moe.d_ff", self.d_ff, allow_zero=True)
        _check_choice("model.moe.mlp", self.mlp, MLP_KINDS)
        _check_choice("model.moe.router", self.router, MOE_ROUTERS)
        _check_positive("model.moe.jitter", self.jitter, allow_zero=True)
        _check_positive("model.moe.capacity_factor", self.capacity_factor)
        _check_choice("model.moe.drop_policy", self.drop_policy, DROP_POLICIES)
        _check_positive("model.moe.n_noop", self.n_noop, allow_zero=True)
        _check_range("model.moe.noop_share", self.noop_share, 0.0, 1.0)
        _check_positive("model.moe.lb_coef", self.lb_coef, allow_zero=True)
        _check_choice("model.moe.lb_scope", self.lb_scope, LB_SCOPES)
        _check_positive("model.moe.z_coef", self.z_coef, allow_zero=True)
        _check_positive("model.moe.bias_rate", self.bias_rate, allow_zero=True)
        # Imported lazily: experts -> config would be fine, config -> experts at import is not.
        from mode.experts.grouped_gemm import BACKEND_NAMES

        _check_choice("model.moe.backend", self.backend, (*BACKEND_NAMES, "auto"))


@dataclass
class ModelConfig:
    """Decoder-only LM. ``layout`` is a comma/space separated pattern of block kinds tiled to
    ``n_layers`` (e.g. "dense,mod" = MoD every other block), or a full per-layer list."""

    vocab_size: int = 256
    seq_len: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    layout: str = "dense,mod"
    tie_embeddings: bool = True
    rope_base: float = 10000.0
    mod: RoutingConfig = field(default_factory=RoutingConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            _check_positive(f"model.{name}", getattr(self, name))
        if self.d_model % self.n_heads:
            _fail("model.d_model", self.d_model, f"must be divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            _fail("model.n_heads", self.n_heads, "head dim d_model/n_heads must be even for RoPE")
        self.block_kinds()  # validates the layout

    def expert_d_ff(self) -> int:
        """Per-expert hidden size: ``moe.d_ff``, or ``mlp_ratio * d_model // top_k`` so that a
        token's active expert FLOPs match the dense MLP."""
        return self.moe.d_ff or max(1, self.mlp_ratio * self.d_model // self.moe.top_k)

    def block_kinds(self) -> list[str]:
        """The per-layer block kinds, the layout pattern tiled to n_layers."""
        pattern = [p for p in self.layout.replace(",", " ").split() if p]
        if not pattern:
            _fail("model.layout", self.layout, f"give a pattern of {list(BLOCK_KINDS)}")
        for p in pattern:
            _check_choice("model.layout", p, BLOCK_KINDS)
        if self.n_layers % len(pattern):
            _fail("model.layout", self.layout, f"pattern length must divide n_layers={self.n_layers}")
        return pattern * (self.n_layers // len(pattern))


@dataclass
class DataConfig:
    """source: "shakespeare" (embedded corpus, fetched and cached on first use), a text file,
    or a nanoGPT-style token file (``.bin`` uint16 / ``.u32`` uint32 memmap)."""

    source: str = "shakespeare"
    cache_dir: str = "data"
    val_fraction: float = 0.05

    def __post_init__(self) -> None:
        _check_range("data.val_fraction", self.val_fraction, 0.0, 0.5, lo_open=True)


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
    out_dir: str = "runs/default"
    resume: bool = False
    seed: int = 1337
    device: str = "cpu"
    threads: int = 0  # torch.set_num_threads; 0 = leave the default
    progress: bool = True

    def __post_init__(self) -> None:
        _check_positive("train.steps", self.steps)
        _check_positive("train.max_seconds", self.max_seconds, allow_zero=True)
        _check_positive("train.batch_size", self.batch_size)
        _check_positive("train.lr", self.lr)
        _check_positive("train.min_lr", self.min_lr, allow_zero=True)
        if self.min_lr > self.lr:
            _fail("train.min_lr", self.min_lr, f"must be <= train.lr={self.lr}")
        _check_positive("train.warmup_steps", self.warmup_steps, allow_zero=True)
        _check_positive("train.weight_decay", self.weight_decay, allow_zero=True)
        _check_positive("train.grad_clip", self.grad_clip, allow_zero=True)
        _check_positive("train.eval_every", self.eval_every)
        _check_positive("train.eval_batches", self.eval_batches)
        _check_positive("train.log_every", self.log_every)
        _check_positive("train.ckpt_every", self.ckpt_every, allow_zero=True)


@dataclass
class ParallelConfig:
    dp_size: int = 1
    ep_size: int = 1

    def __post_init__(self) -> None:
        _check_positive("parallel.dp_size", self.dp_size)
        _check_positive("parallel.ep_size", self.ep_size)


@dataclass
class Config:
    name: str = "default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.model.n_layers and self.parallel.ep_size > 1:
            if self.model.moe.n_experts % self.parallel.ep_size:
                _fail(
                    "parallel.ep_size",
                    self.parallel.ep_size,
                    f"model.moe.n_experts={self.model.moe.n_experts} must be divisible by it",
                )


def preset_names() -> list[str]:
    """Names of the YAML presets shipped in ``configs/``."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def _resolve(preset: str | Path) -> Path:
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    candidate = CONFIG_DIR / f"{preset}.yaml"
    if candidate.exists():
        return candidate
    raise FileNotFoundError(f"no config {str(preset)!r}: give a YAML path or one of {preset_names()}")


def _preset_layers(preset: str | Path, seen: tuple[Path, ...] = ()) -> list:
    """A preset's YAML, preceded by the presets it names under ``base:`` (recursively)."""
    path = _resolve(preset)
    if path in seen:
        raise ValueError(f"base: presets form a cycle through {path.name}")
    node = OmegaConf.load(path)
    base = node.pop("base", None)
    return ([*_preset_layers(base, (*seen, path))] if base else []) + [node]


def load_config(preset: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build a validated ``Config`` from defaults, a preset (name in ``configs/`` or a YAML
    path; a preset may start from another with ``base: <name>``) and CLI dotlist overrides
    such as ``["model.n_layers=8"]``."""
    layers = []
    if preset is not None:
        layers.extend(_preset_layers(preset))
    if overrides:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
    return _build(layers)


def from_dict(values: dict) -> Config:
    """A validated ``Config`` from nested values, e.g. ``to_dict`` of one saved in a checkpoint."""
    return _build([OmegaConf.create(values)])


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
        raise ValueError(f"{key}: {str(err).splitlines()[0]}") from None


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))  # type: ignore[return-value]
