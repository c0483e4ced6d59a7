"""Every layer option is written once: in its options dataclass, which the config section and
the layer's keyword constructor both build, and which the layer keeps as ``opts``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mode
from mode.config import ModelConfig, load_config
from mode.experts.moe import MoEConfig, MoELayer
from mode.layers.early_exit import EarlyExit, EarlyExitConfig
from mode.layers.mod import MoDBlock, RoutingConfig
from mode.model import MoDETransformer

D = 16


def with_extra_field(cls: type) -> type:
    """``cls`` with one more field, ``extra`` (a throwaway option no layer knows)."""
    return dataclasses.make_dataclass(f"Extra{cls.__name__}", [("extra", int, 0)], bases=(cls,))


def test_a_new_moe_option_reaches_every_moe_layer_of_a_model_with_no_other_edit():
    """Adding a field to ``MoEConfig`` is the whole edit: a model's MoE layers (plain, capacity,
    staged and integrated blocks) all hold it, through the one build path."""
    moe = with_extra_field(MoEConfig)(n_experts=4, extra=7)
    cfg = ModelConfig(
        d_model=D, n_heads=2, n_layers=4, seq_len=16, layout="moe,moe_capacity,mode_staged,mode_integrated"
    )
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(moe, n_noop=0))
    layers = [m for m in MoDETransformer(cfg).modules() if isinstance(m, MoELayer)]
    assert len(layers) == 4
    assert all(layer.opts.extra == 7 for layer in layers)
    assert [type(layer).__name__ for layer in layers] == ["DroplessMoE", "CapacityMoE", "DroplessMoE", "DroplessMoE"]


def test_a_new_routing_option_reaches_the_mod_blocks_with_no_other_edit():
    routing = with_extra_field(RoutingConfig)(capacity=0.25, extra=3)
    cfg = dataclasses.replace(
        ModelConfig(d_model=D, n_heads=2, n_layers=2, seq_len=16, layout="mod,mod_random"), mod=routing
    )
    blocks = [m for m in MoDETransformer(cfg).modules() if isinstance(m, MoDBlock)]
    assert [b.opts.extra for b in blocks] == [3, 3]
    assert [b.capacity for b in blocks] == [0.25, 0.25]
    assert blocks[1].gate == "none" and not blocks[1].router.weight.requires_grad  # random routing decides its own


@pytest.mark.parametrize(
    ("build", "keyword", "field"),
    [
        (lambda: mode.DroplessMoE(D, 32, 4, top_k=9), "top_k=9", "model.moe.top_k=9"),
        (lambda: mode.MoDBlock(D, 2, capacity=2.0), "capacity=2.0", "model.mod.capacity=2.0"),
        (lambda: EarlyExit(4, threshold=1.5), "threshold=1.5", "model.early_exit.threshold=1.5"),
        (lambda: mode.StagedMoDEBlock(D, 2, gate="sigmod"), "gate='sigmod'", "model.mod.gate='sigmod'"),
        (lambda: mode.StagedMoDEBlock(D, 2, lb_scope="batch"), "lb_scope='batch'", "model.moe.lb_scope='batch'"),
    ],
)
def test_a_keyword_error_names_the_keyword_and_a_config_error_the_field(build, keyword, field):
    with pytest.raises(ValueError) as err:
        build()
    assert str(err.value).startswith(keyword), err.value
    with pytest.raises(ValueError) as err:
        load_config("mode_staged", [field.replace("'", "")])
    assert str(err.value).startswith(field), err.value


def test_a_config_error_of_the_architecture_names_its_model_field():
    for override, named in [("model.norm=batchnorm", "model.norm="), ("model.n_kv_heads=3", "model.n_kv_heads=3")]:
        with pytest.raises(ValueError) as err:
            load_config("dense", [override])
        assert str(err.value).startswith(named), err.value
    with pytest.raises(ValueError, match=r"^norm="):
        mode.layers.arch.Arch(norm="batchnorm")


@pytest.mark.parametrize(
    "build",
    [
        lambda: mode.DroplessMoE(D, 32, top_k=2, opts=MoEConfig(n_experts=4)),
        lambda: mode.MoDBlock(D, 2, 0.5, opts=RoutingConfig()),
        lambda: EarlyExit(4, EarlyExitConfig(enabled=True), threshold=0.5),
        lambda: mode.StagedMoDEBlock(D, 2, moe=mode.DroplessMoE(D, 32, 4), n_experts=4),
        lambda: mode.IntegratedMoDEBlock(D, 2, moe=mode.DroplessMoE(D, 32, 4, n_noop=2), d_ff=8),
    ],
    ids=["moe", "mod", "early-exit", "staged", "integrated"],
)
def test_options_given_twice_are_refused(build):
    """``opts`` and keywords, or a built MoE and MoE keywords: one source, never a silent choice."""
    with pytest.raises(TypeError, match="not both|takes no MoE options"):
        build()


def test_keywords_and_opts_build_the_same_layer():
    """The keyword API users know builds what the options object builds (same weights from one seed)."""
    torch.manual_seed(0)
    a = mode.StagedMoDEBlock(D, 2, capacity=0.5, n_experts=4, top_k=2, causal="predictor", lb_coef=0.0)
    torch.manual_seed(0)
    moe = mode.DroplessMoE(D, mode.experts.moe.expert_width(D, 2), opts=MoEConfig(n_experts=4, top_k=2, lb_coef=0.0))
    b = mode.StagedMoDEBlock(D, 2, opts=RoutingConfig(capacity=0.5, causal="predictor"), moe=moe)
    assert a.opts == b.opts and a.block.mlp.opts == b.block.mlp.opts
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
