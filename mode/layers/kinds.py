"""The table of block kinds a ``ModelConfig.layout`` is written in.

Each entry says how to build the block from the model config, its forward FLOPs, whether it
holds experts (expert parallelism shards them) and whether it can decode token by token (its
routing decides per token: see ``mode.routed.Routed.non_causal_reason``). ``build_block``,
``mode.flops``, config validation, the parallel set-up and the benchmarks read it; adding a
kind is one entry here plus its block class. Every kind also has a preset of its name in
``mode/configs``.

The MoE inside the "moe", "moe_capacity" and both MoDE kinds comes from one factory,
``build_moe``, with the width ``ModelConfig.expert_d_ff()``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from mode.experts.mlp import mlp_flops
from mode.experts.moe import MOE_CLASSES, MoELayer, moe_flops
from mode.layers.attention import attention_flops
from mode.layers.blocks import DenseBlock, IntegratedMoDEBlock, MoEBlock
from mode.layers.mod import MoDBlock, RandomMoDBlock, StagedMoDEBlock
from mode.routing.mod_topk import capacity_to_k

if TYPE_CHECKING:
    from mode.config import ModelConfig


def build_moe(cfg: ModelConfig, capacity: bool = False, n_noop: int = 0) -> MoELayer:
    """The MoE layer ``cfg.moe`` describes: ``CapacityMoE`` when ``capacity``, else by
    ``moe.router`` (``DroplessMoE`` for token choice, ``ExpertChoiceMoE``)."""
    return MOE_CLASSES[_moe_layer(cfg, capacity)].from_config(cfg.d_model, cfg.moe, cfg.expert_d_ff(), n_noop)


def _moe_layer(cfg: ModelConfig, capacity: bool = False) -> str:
    if capacity:
        return "capacity"
    return "expert_choice" if cfg.moe.router == "expert_choice" else "dropless"


@dataclass(frozen=True)
class BlockKind:
    """build(cfg) -> block; flops(cfg, T, masked) -> forward FLOPs of one block on one
    sequence of T tokens (``masked``: see ``attention_flops``); holds_experts; causal(cfg):
    whether the built block decides per token (``routing="causal"``, KV-cache decoding)."""

    build: Callable[[ModelConfig], nn.Module]
    flops: Callable[[ModelConfig, int, bool], int]
    holds_experts: bool
    causal: Callable[[ModelConfig], bool]


# -- per-kind FLOPs --------------------------------------------------------------------------
def _dense_flops(cfg: ModelConfig, T: int, masked: bool) -> int:
    d = cfg.d_model
    return attention_flops(T, d, masked) + mlp_flops(T, d, cfg.mlp_ratio * d)


def _mod_router_flops(cfg: ModelConfig, T: int) -> int:
    router = 2 * T * cfg.d_model
    if cfg.mod.causal == "predictor":  # the routing predictor runs on every token
        router += 2 * T * cfg.mod.predictor_hidden * (cfg.d_model + 1)
    return router


def _mod_flops(cfg: ModelConfig, T: int, masked: bool) -> int:
    k = capacity_to_k(cfg.mod.capacity, T)
    return _mod_router_flops(cfg, T) + (_dense_flops(cfg, k, masked) if k else 0)


def _mod_random_flops(cfg: ModelConfig, T: int, masked: bool) -> int:
    k = capacity_to_k(cfg.mod.capacity, T)
    return _dense_flops(cfg, k, masked) if k else 0  # no router: random scores


def _moe_block_flops(cfg: ModelConfig, T: int, masked: bool, capacity: bool = False, n_noop: int = 0) -> int:
    # Integrated MoDE: the balance loss targets ``noop_share`` of assignments on the no-op
    # experts, so that share is expected to cost nothing.
    real_share = 1.0 - (cfg.moe.noop_share if n_noop else 0.0)
    layer = _moe_layer(cfg, capacity)
    moe = moe_flops(T, cfg.d_model, cfg.expert_d_ff(), cfg.moe, layer, real_share, n_noop)
    return attention_flops(T, cfg.d_model, masked) + moe


def _staged_flops(cfg: ModelConfig, T: int, masked: bool) -> int:
    k = capacity_to_k(cfg.mod.capacity, T)
    return _mod_router_flops(cfg, T) + (_moe_block_flops(cfg, k, masked) if k else 0)


# -- the table -------------------------------------------------------------------------------
def _dense(cfg: ModelConfig) -> nn.Module:
    return DenseBlock(cfg.d_model, cfg.n_heads, cfg.mlp_ratio, cfg.rope_base)


def _mod(cfg: ModelConfig) -> nn.Module:
    return MoDBlock.from_config(cfg.d_model, cfg.n_heads, cfg.mod, mlp_ratio=cfg.mlp_ratio, rope_base=cfg.rope_base)


def _mod_random(cfg: ModelConfig) -> nn.Module:
    return RandomMoDBlock(cfg.d_model, cfg.n_heads, cfg.mod.capacity, cfg.mlp_ratio, cfg.rope_base, cfg.mod.kernels)


def _moe(capacity: bool) -> Callable[[ModelConfig], nn.Module]:
    return lambda cfg: MoEBlock(cfg.d_model, cfg.n_heads, build_moe(cfg, capacity), cfg.rope_base)


def _staged(cfg: ModelConfig) -> nn.Module:
    return StagedMoDEBlock.from_config(cfg.d_model, cfg.n_heads, cfg.mod, moe=build_moe(cfg), rope_base=cfg.rope_base)


def _integrated(cfg: ModelConfig) -> nn.Module:
    moe = build_moe(cfg, n_noop=cfg.moe.n_noop)
    return IntegratedMoDEBlock(cfg.d_model, cfg.n_heads, moe=moe, rope_base=cfg.rope_base)


def _mod_causal(cfg: ModelConfig) -> bool:
    return cfg.mod.causal != "none"


def _token_choice(cfg: ModelConfig) -> bool:
    return cfg.moe.router == "token_choice"


BLOCK_KINDS: dict[str, BlockKind] = {
    "dense": BlockKind(_dense, _dense_flops, False, lambda cfg: True),
    "mod": BlockKind(_mod, _mod_flops, False, _mod_causal),
    "mod_random": BlockKind(_mod_random, _mod_random_flops, False, lambda cfg: False),
    "moe": BlockKind(_moe(False), _moe_block_flops, True, _token_choice),
    "moe_capacity": BlockKind(
        _moe(True), lambda cfg, T, m: _moe_block_flops(cfg, T, m, capacity=True), True, lambda cfg: False
    ),
    "mode_staged": BlockKind(_staged, _staged_flops, True, lambda cfg: _mod_causal(cfg) and _token_choice(cfg)),
    "mode_integrated": BlockKind(
        _integrated, lambda cfg, T, m: _moe_block_flops(cfg, T, m, n_noop=cfg.moe.n_noop), True, _token_choice
    ),
}


def block_kind(kind: str) -> BlockKind:
    if kind not in BLOCK_KINDS:
        raise ValueError(f"unknown block kind {kind!r}: choose one of {list(BLOCK_KINDS)}")
    return BLOCK_KINDS[kind]


def build_block(kind: str, cfg: ModelConfig) -> nn.Module:
    """One block of the given layout kind, sized by ``cfg``."""
    return block_kind(kind).build(cfg)
