"""The table of block kinds a ``ModelConfig.layout`` is written in.

Each row says how to build the block from the model's options (any object shaped like
``ModelShape``: ``mode.config.ModelConfig``), its forward FLOPs, and the three facts the rest
of the package asks about a layout: whether the block holds experts (expert parallelism
shards them, upcycling fills them), has no-op experts (``model.moe.n_noop`` applies), and
routes depth (MoD: tokens skip it, and the model is also evaluated with causal routing).
Whether a built block decodes token by token is the block's own answer
(``mode.routed.Routed.non_causal_reason``). ``build_block``, ``mode.flops``, config
validation, upcycling, training and the benchmarks read the table; adding a kind is one row
here plus its block class. Every kind also has a preset of its name in ``mode/configs``.

The MoE inside the "moe", "moe_capacity" and both MoDE kinds comes from one factory,
``build_moe``, with the width ``ModelShape.expert_d_ff()``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from torch import nn

from mode.experts.mlp import mlp_flops
from mode.experts.moe import MoEConfig, MoELayer, build_moe_layer, moe_flops, moe_layer_kind
from mode.layers.arch import Arch
from mode.layers.attention import attention_flops
from mode.layers.blocks import DenseBlock, IntegratedMoDEBlock, MoEBlock
from mode.layers.mod import MoDBlock, RandomMoDBlock, RoutingConfig, StagedMoDEBlock
from mode.routing.mod_topk import capacity_to_k


class ModelShape(Protocol):
    """What a row needs from the model's options (``mode.config.ModelConfig`` has it)."""

    d_model: int
    n_heads: int
    mlp_ratio: int
    mod: RoutingConfig
    moe: MoEConfig

    def expert_d_ff(self) -> int: ...

    def dense_d_ff(self) -> int: ...

    def arch(self) -> Arch: ...


def build_moe(cfg: ModelShape, capacity: bool = False, n_noop: int = 0) -> MoELayer:
    """The MoE layer ``cfg.moe`` describes, with ``n_noop`` no-op experts (only the integrated
    block has them): ``CapacityMoE`` when ``capacity``, else by ``moe.router``
    (``mode.experts.moe.build_moe_layer``)."""
    return build_moe_layer(cfg.d_model, replace(cfg.moe, n_noop=n_noop), cfg.expert_d_ff(), capacity)


@dataclass(frozen=True, kw_only=True)
class BlockKind:
    """build(cfg) -> block; flops(cfg, T, masked) -> forward FLOPs of one block on one
    sequence of T tokens (``masked``: see ``attention_flops``); holds_experts: has an MoE
    layer with real experts; has_noop_experts: its MoE router also has ``moe.n_noop`` no-op
    experts; routes_depth: a MoD router sends only some tokens through it."""

    build: Callable[[ModelShape], nn.Module]
    flops: Callable[[ModelShape, int, bool], int]
    holds_experts: bool = False
    has_noop_experts: bool = False
    routes_depth: bool = False


# -- per-kind FLOPs --------------------------------------------------------------------------
def _attention_flops(cfg: ModelShape, T: int, masked: bool) -> int:
    arch = cfg.arch()
    return attention_flops(T, cfg.d_model, masked, arch.kv_heads(cfg.n_heads) / cfg.n_heads)


def _dense_flops(cfg: ModelShape, T: int, masked: bool) -> int:
    mlp = "swiglu" if cfg.arch().mlp == "swiglu" else "gelu"
    return _attention_flops(cfg, T, masked) + mlp_flops(T, cfg.d_model, cfg.dense_d_ff(), mlp)


def _mod_router_flops(cfg: ModelShape, T: int) -> int:
    router = 2 * T * cfg.d_model
    if cfg.mod.causal == "predictor":  # the routing predictor runs on every token
        router += 2 * T * cfg.mod.predictor_hidden * (cfg.d_model + 1)
    return router


def _mod_flops(cfg: ModelShape, T: int, masked: bool) -> int:
    k = capacity_to_k(cfg.mod.capacity, T)
    return _mod_router_flops(cfg, T) + (_dense_flops(cfg, k, masked) if k else 0)


def _mod_random_flops(cfg: ModelShape, T: int, masked: bool) -> int:
    k = capacity_to_k(cfg.mod.capacity, T)
    return _dense_flops(cfg, k, masked) if k else 0  # no router: random scores


def _moe_block_flops(cfg: ModelShape, T: int, masked: bool, capacity: bool = False, n_noop: int = 0) -> int:
    # Integrated MoDE: the balance loss targets ``noop_share`` of assignments on the no-op
    # experts, so that share is expected to cost nothing.
    real_share = 1.0 - (cfg.moe.noop_share if n_noop else 0.0)
    layer = moe_layer_kind(cfg.moe, capacity)
    moe = moe_flops(T, cfg.d_model, cfg.expert_d_ff(), cfg.moe, layer, real_share, n_noop)
    return _attention_flops(cfg, T, masked) + moe


def _staged_flops(cfg: ModelShape, T: int, masked: bool) -> int:
    k = capacity_to_k(cfg.mod.capacity, T)
    return _mod_router_flops(cfg, T) + (_moe_block_flops(cfg, k, masked) if k else 0)


# -- the table -------------------------------------------------------------------------------
def _dense(cfg: ModelShape) -> nn.Module:
    return DenseBlock(cfg.d_model, cfg.n_heads, arch=cfg.arch(), d_ff=cfg.dense_d_ff())


def _mod(cfg: ModelShape) -> nn.Module:
    return MoDBlock(cfg.d_model, cfg.n_heads, opts=cfg.mod, inner=_dense(cfg))


def _mod_random(cfg: ModelShape) -> nn.Module:
    return RandomMoDBlock(cfg.d_model, cfg.n_heads, opts=cfg.mod, inner=_dense(cfg))


def _moe(capacity: bool) -> Callable[[ModelShape], nn.Module]:
    return lambda cfg: MoEBlock(cfg.d_model, cfg.n_heads, build_moe(cfg, capacity), cfg.arch())


def _staged(cfg: ModelShape) -> nn.Module:
    return StagedMoDEBlock(cfg.d_model, cfg.n_heads, opts=cfg.mod, moe=build_moe(cfg), arch=cfg.arch())


def _integrated(cfg: ModelShape) -> nn.Module:
    moe = build_moe(cfg, n_noop=cfg.moe.n_noop)
    return IntegratedMoDEBlock(cfg.d_model, cfg.n_heads, moe=moe, arch=cfg.arch())


BLOCK_KINDS: dict[str, BlockKind] = {
    "dense": BlockKind(build=_dense, flops=_dense_flops),
    "mod": BlockKind(build=_mod, flops=_mod_flops, routes_depth=True),
    "mod_random": BlockKind(build=_mod_random, flops=_mod_random_flops, routes_depth=True),
    "moe": BlockKind(build=_moe(False), flops=_moe_block_flops, holds_experts=True),
    "moe_capacity": BlockKind(
        build=_moe(True), flops=lambda cfg, T, m: _moe_block_flops(cfg, T, m, capacity=True), holds_experts=True
    ),
    "mode_staged": BlockKind(build=_staged, flops=_staged_flops, holds_experts=True, routes_depth=True),
    "mode_integrated": BlockKind(
        build=_integrated,
        flops=lambda cfg, T, m: _moe_block_flops(cfg, T, m, n_noop=cfg.moe.n_noop),
        holds_experts=True,
        has_noop_experts=True,
    ),
}


def any_kind(kinds: list[str], flag: str) -> bool:
    """Whether any of ``kinds`` (a layout's per-layer kinds) has ``flag`` (a ``BlockKind`` field)."""
    return any(getattr(block_kind(k), flag) for k in kinds)


def block_kind(kind: str) -> BlockKind:
    if kind not in BLOCK_KINDS:
        raise ValueError(f"unknown block kind {kind!r}: choose one of {list(BLOCK_KINDS)}")
    return BLOCK_KINDS[kind]


def build_block(kind: str, cfg: ModelShape) -> nn.Module:
    """One block of the given layout kind, sized by ``cfg``."""
    return block_kind(kind).build(cfg)
