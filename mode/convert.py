"""Upcycling: a trained dense model converted into MoD, MoE or MoDE, to continue training.

``upcycle(source, target)`` builds the model ``target`` describes and fills it from a dense
model of the same width, depth, heads and vocabulary:

- embeddings, final norm, LM head and every block's attention and norms are copied;
- a **dense** target block is copied whole;
- a **MoD** block (``mod``) routes around the copied dense block. Its router bias starts at
  ``logit(gate_init)`` (sigmoid gate; ``gate_init`` itself for the identity gate), so a
  routed token's update is ``gate_init`` (0.95) of the dense block's at init; the bias moves
  every score alike and never changes which tokens are picked. The router weights start
  small and random (``router_std``), so scores follow token content, not position; the
  causal predictor starts as a fresh one (its threshold calibrates on the first step);
- an **MoE** MLP (``moe``, ``moe_capacity``, ``mode_staged``'s inner block,
  ``mode_integrated``) gets experts from the dense MLP: with ``d_ff`` equal to the dense
  hidden width every expert is a copy; with ``d_ff * top_k`` equal to it (the presets' "same
  active FLOPs" width) expert e holds hidden slice ``e mod top_k`` and scales its output by
  ``top_k``, so that a token whose top-k experts hold different slices and get equal weights
  (a near-uniform router) computes the dense MLP. Other widths are refused. With top-1
  routing a token's output is its router probability times its expert's (Switch), ~1/E of
  the dense MLP at a near-uniform router: convert to top-2 (the presets) or to one expert
  to keep the dense function. The router starts
  near uniform (weights ~ N(0, router_std^2)); no-op experts cost nothing and start like the
  others in the router. ``noise`` adds N(0, (noise * std)^2) to each expert's copy to break
  their symmetry.

Everything random comes from ``seed``: the conversion is deterministic.

A Hugging Face checkpoint directory is a source too, written ``hf:<dir>`` (``mode.hf``
reads it). Its shape and architecture then define the target's: the target keeps its
layout, routing and expert options, takes every ``model.*`` field of the published model
(``seq_len`` only when its positions are learned), experts compute its MLP, and with
``moe.d_ff: 0`` they are its hidden width over ``top_k`` (the presets' same-active-FLOPs
width).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from torch import nn

from mode import checkpoint
from mode.checks import fail
from mode.config import Config, ModelConfig
from mode.experts.moe import MoELayer
from mode.layers.blocks import DenseBlock, TransformerBlock
from mode.layers.kinds import any_kind
from mode.layers.mod import MoDBlock
from mode.model import MoDETransformer

StateDict = dict[str, torch.Tensor]
HF_PREFIX = "hf:"


def load_dense(source: str | Path | MoDETransformer | StateDict, config: ModelConfig | None = None):
    """``(state dict, ModelConfig)`` of a dense model: a checkpoint of either kind (its own
    config), a ``MoDETransformer`` or a state dict with its ``config``."""
    if isinstance(source, MoDETransformer):
        return source.state_dict(), source.cfg
    if isinstance(source, dict):
        if config is None:
            raise ValueError("upcycling from a state dict needs the dense model's ModelConfig: pass dense_config=")
        return source, config
    if is_hf(source):
        from mode.hf import from_hf  # noqa: PLC0415  (the hf extra)

        model = from_hf(published_dir(source))
        return model.state_dict(), model.cfg
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"no dense checkpoint at {path} (train.init_from / --init-from)")
    cfg = checkpoint.checkpoint_config(path).model
    model = MoDETransformer(cfg)
    checkpoint.load(path, model)
    return model.state_dict(), cfg


def is_hf(source: object) -> bool:
    """Whether an upcycling source names a Hugging Face checkpoint directory (``hf:<dir>``)."""
    return isinstance(source, (str, Path)) and str(source).startswith(HF_PREFIX)


def published_dir(source: str | Path) -> Path:
    """The directory an ``hf:<dir>`` source names."""
    return Path(str(source).removeprefix(HF_PREFIX))


def hf_source_config(source: str | Path) -> ModelConfig:
    """The ``ModelConfig`` of an ``hf:<dir>`` source, dense or MoE (reads its ``config.json`` only)."""
    from mode.hf import config_from_hf, hf_config  # noqa: PLC0415

    return config_from_hf(hf_config(published_dir(source)))


# what a target takes over from a published model: every model field but these
KEPT_BY_TARGET = ("layout", "mod", "moe", "early_exit", "attention", "seq_len")
# ... and what a target must share with any dense source (its shape and architecture, from
# the same field list: a new architecture option is matched without being listed here); the
# MLP width is compared as ``dense_d_ff()``, however it is written
MATCHED = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in (*KEPT_BY_TARGET, "d_ff", "mlp_ratio"))


def _taken_from(published: ModelConfig) -> dict:
    """The fields a target takes from a published model: all but ``KEPT_BY_TARGET``, and
    ``seq_len`` when its positions are learned (they end there)."""
    taken = {
        f.name: getattr(published, f.name) for f in dataclasses.fields(ModelConfig) if f.name not in KEPT_BY_TARGET
    }
    if published.positions == "learned":
        taken["seq_len"] = published.seq_len
    return taken


def with_dense_shape(target: ModelConfig, dense: ModelConfig) -> ModelConfig:
    """``target`` with the dense model's shape and architecture (see the module docstring)."""
    taken = _taken_from(dense)
    moe = target.moe
    if any_kind(target.block_kinds(), "holds_experts"):
        mlp = dense.mlp if dense.mlp in ("gelu", "swiglu") else moe.mlp  # else refused by check_convertible
        moe = dataclasses.replace(moe, mlp=mlp, d_ff=moe.d_ff or max(1, dense.dense_d_ff() // moe.top_k))
    return dataclasses.replace(target, **taken, moe=moe)


# a published MoE model's options a target keeps (training, not the function: losses, balance,
# backend) ...
MOE_KEPT_BY_TARGET = (
    "backend",
    "jitter",
    "capacity_factor",
    "drop_policy",
    "n_noop",
    "noop_share",
    "lb_coef",
    "lb_scope",
    "z_coef",
    "bias_rate",
    "token_moves",
)
# ... and what each target block kind makes of a published block of each kind (any other pair:
# the published block as it is)
WRAPPED = {
    ("moe", "mode_staged"): "mode_staged",  # MoD routing around the published MoE block
    ("moe", "mode_integrated"): "mode_integrated",  # its router gains the no-op experts
    ("moe", "mod"): "mode_staged",  # MoD around an MoE block is staged MoDE
    ("dense", "mod"): "mod",
    ("dense", "mode_staged"): "mod",  # MoD around a dense block: staged MoDE with no experts
}
TARGETS_OF_PUBLISHED_MOE = ("dense", "moe", "mod", "mode_staged", "mode_integrated")


def with_published_moe(target: ModelConfig, published: ModelConfig) -> ModelConfig:
    """``target`` over a published MoE model (see ``published_shape``): every block is the
    published one (its experts, router and shared expert as they are), wrapped where the
    target's layout routes depth there (``WRAPPED``); the target keeps its routing, early
    exit, attention backend and MoE training options (``MOE_KEPT_BY_TARGET``)."""
    tiled = dataclasses.replace(target, n_layers=published.n_layers)
    try:
        wanted = tiled.block_kinds()
    except ValueError as e:
        raise type(e)(f"{e} (the published model's {published.n_layers} layers)") from None
    for kind in wanted:
        if kind not in TARGETS_OF_PUBLISHED_MOE:
            fail(
                "model.layout",
                target.layout,
                f"a published MoE model becomes {list(TARGETS_OF_PUBLISHED_MOE)} blocks, not {kind!r}",
            )
    kinds = [WRAPPED.get((have, want), have) for have, want in zip(published.block_kinds(), wanted, strict=True)]
    moe = dataclasses.replace(published.moe, **{k: getattr(target.moe, k) for k in MOE_KEPT_BY_TARGET})
    return dataclasses.replace(target, **_taken_from(published), layout=",".join(kinds), moe=moe)


def published_shape(target: ModelConfig, published: ModelConfig) -> ModelConfig:
    """The model a run from a published model (``hf:<dir>``) trains: a dense one's shape and
    architecture under the target's layout (``with_dense_shape``), or a published MoE model
    as it is, wrapped where the target routes depth (``with_published_moe``)."""
    if any_kind(published.block_kinds(), "holds_experts"):
        return with_published_moe(target, published)
    return with_dense_shape(target, published)


def check_convertible(dense: ModelConfig, target: ModelConfig) -> None:
    """``ConfigError`` naming the first target field that cannot map onto the dense model."""
    kinds = dense.block_kinds()
    if set(kinds) != {"dense"}:
        fail("source", dense.layout, "upcycling starts from a dense model (layout 'dense')")
    for name in MATCHED:
        if getattr(target, name) != getattr(dense, name):
            fail(
                f"model.{name}",
                getattr(target, name),
                f"must equal the dense model's {name}={getattr(dense, name)!r}: upcycling keeps the dense weights, "
                "so width, depth, heads, vocabulary, architecture, tied embeddings and RoPE base cannot change",
            )
    if target.dense_d_ff() != dense.dense_d_ff():
        fail(
            "model.d_ff",
            target.d_ff,
            f"the dense MLP is {dense.dense_d_ff()} wide: set model.d_ff={dense.dense_d_ff()} (or the same mlp_ratio)",
        )
    if dense.positions == "learned" and target.seq_len != dense.seq_len:
        fail("model.seq_len", target.seq_len, f"learned positions end at the dense model's seq_len={dense.seq_len}")
    if any_kind(target.block_kinds(), "holds_experts"):
        hidden, d_ff, k = dense.dense_d_ff(), target.expert_d_ff(), target.moe.top_k
        if dense.mlp not in ("gelu", "swiglu"):
            fail("model.mlp", dense.mlp, "experts compute GELU or SwiGLU: a dense gelu_tanh MLP cannot become experts")
        if dense.bias:
            fail("model.bias", True, "experts have no biases: a dense model with MLP biases cannot become experts")
        if target.moe.mlp != dense.mlp:
            fail("model.moe.mlp", target.moe.mlp, f"the dense MLP is {dense.mlp}: upcycle to moe.mlp={dense.mlp!r}")
        if target.moe.shared_expert:
            fail("model.moe.shared_expert", True, "upcycling fills routed experts only: use false")
        if target.moe.router != "token_choice":
            fail("model.moe.router", target.moe.router, "upcycling supports token-choice routers")
        if d_ff != hidden and d_ff * k != hidden:
            fail(
                "model.moe.d_ff",
                d_ff,
                f"experts are copies or top_k slices of the dense MLP (hidden {hidden}): use d_ff={hidden} "
                f"or d_ff={hidden}/top_k={hidden // k}",
            )


def upcycle(
    source: str | Path | MoDETransformer | StateDict,
    target: Config | ModelConfig,
    *,
    dense_config: ModelConfig | None = None,
    seed: int = 0,
    noise: float = 0.0,
    router_std: float = 0.02,
    gate_init: float = 0.95,
) -> MoDETransformer:
    """The ``target`` model filled from the dense ``source`` (see the module docstring).

    ``source``: a checkpoint path (``ckpt.pt`` or a DCP ``ckpt/``), ``hf:<dir>`` (a Hugging
    Face checkpoint, whose shape the target takes), a ``MoDETransformer`` or a state dict
    (then ``dense_config`` is required). Raises ``ConfigError`` naming the field when the
    target cannot be filled from that model."""
    tcfg = target.model if isinstance(target, Config) else target
    state, dcfg = load_dense(source, dense_config)
    if not 0.0 < gate_init < 1.0:
        fail("gate_init", gate_init, "must be in (0, 1)")
    gen = torch.Generator().manual_seed(seed)
    if is_hf(source) and any_kind(dcfg.block_kinds(), "holds_experts"):
        return _wrap_published_moe(state, with_published_moe(tcfg, dcfg), seed, gen, router_std, gate_init)
    if is_hf(source):
        tcfg = with_dense_shape(tcfg, dcfg)
    check_convertible(dcfg, tcfg)
    model = _seeded_model(tcfg, seed, state)
    for i, block in enumerate(model.blocks):
        _fill_block(block, _block_state(state, i), gen, noise, router_std, gate_init)
    return model


def _seeded_model(cfg: ModelConfig, seed: int, state: StateDict) -> MoDETransformer:
    """The model ``cfg`` built under ``seed`` (the global RNG left as it was), holding the
    source's weights outside the blocks (embeddings, final norm, head)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MoDETransformer(cfg)
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("blocks.")}, strict=False)
    return model


def _block_state(state: StateDict, i: int) -> StateDict:
    """Block ``i``'s weights in a whole model's state dict, under the block's own names."""
    prefix = f"blocks.{i}."
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


@torch.no_grad()
def _wrap_published_moe(
    state: StateDict, cfg: ModelConfig, seed: int, gen, router_std: float, gate_init: float
) -> MoDETransformer:
    """The model ``cfg`` (``with_published_moe``) holding a published MoE model's weights
    ``state``: its blocks as they are, inside a MoD router where wrapped (started as
    upcycling starts one), and an integrated block's router keeping the published rows of
    its real experts, the no-op experts' rows starting small and random."""
    model = _seeded_model(cfg, seed, state)
    for i, block in enumerate(model.blocks):
        published = _block_state(state, i)
        if isinstance(block, MoDBlock):
            _start_mod_router(block, gen, router_std, gate_init)
            block.block.load_state_dict(published)
        elif isinstance(block, TransformerBlock) and isinstance(block.mlp, MoELayer) and block.mlp.n_noop:
            real = block.mlp.n_experts
            rows = {"mlp.router.weight", "mlp.selection_bias"}
            block.load_state_dict({k: v for k, v in published.items() if k not in rows}, strict=False)
            _normal(block.mlp.router.weight, router_std, gen)
            block.mlp.router.weight[:real] = published["mlp.router.weight"]
            block.mlp.selection_bias.zero_()
            block.mlp.selection_bias[:real] = published["mlp.selection_bias"]
        else:
            block.load_state_dict(published)
    return model


def _start_mod_router(block: MoDBlock, gen, router_std: float, gate_init: float) -> None:
    _normal(block.router.weight, router_std, gen)
    gate = block.gate
    block.router.bias.fill_(math.log(gate_init / (1 - gate_init)) if gate == "sigmoid" else gate_init)


@torch.no_grad()
def _fill_block(block: nn.Module, dense: StateDict, gen, noise: float, router_std: float, gate_init: float) -> None:
    if isinstance(block, MoDBlock):
        _start_mod_router(block, gen, router_std, gate_init)
        _fill_block(block.block, dense, gen, noise, router_std, gate_init)
    elif isinstance(block, DenseBlock):
        block.load_state_dict(dense)
    elif isinstance(block, TransformerBlock) and isinstance(block.mlp, MoELayer):
        shared = {k: v for k, v in dense.items() if not k.startswith("mlp.")}
        block.load_state_dict(shared, strict=False)
        up = dense.get("mlp.up.weight")
        _fill_moe(block.mlp, dense["mlp.fc.weight"], dense["mlp.proj.weight"], up, gen, noise, router_std)
    else:
        raise TypeError(f"upcycling does not know how to fill a {type(block).__name__}")


def _fill_moe(
    moe: MoELayer, fc: torch.Tensor, proj: torch.Tensor, up: torch.Tensor | None, gen, noise: float, router_std: float
) -> None:
    """Experts from the dense MLP ``fc`` [H, D], ``proj`` [D, H] and SwiGLU's ``up`` [H, D]
    (None for GELU; see the module docstring). SwiGLU acts per hidden unit, so a slice of
    the hidden units is a slice of the function as for GELU."""
    E, _, d_ff = moe.experts.w1.shape
    H = fc.shape[0]
    k = 1 if d_ff == H else moe.top_k
    for e in range(E):
        hidden = slice((e % k) * d_ff, (e % k + 1) * d_ff)
        moe.experts.w1[e] = fc[hidden].T
        moe.experts.w2[e] = proj[:, hidden].T * k
        if up is not None:
            moe.experts.w3[e] = up[hidden].T
        if noise:
            for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
                if w is not None:
                    w[e] += noise * w[e].std() * torch.randn(w[e].shape, generator=gen)
    _normal(moe.router.weight, router_std, gen)


def _normal(w: torch.Tensor, std: float, gen: torch.Generator) -> None:
    w.copy_(torch.randn(w.shape, generator=gen) * std)
