"""Staged and integrated MoDE blocks, and every preset end to end."""

import pytest
import torch

from mode import IntegratedMoDEBlock, StagedMoDEBlock
from mode.checkpoint import load_checkpoint
from mode.config import load_config, preset_names
from mode.experts.moe import DroplessMoE
from mode.layers.blocks import MoEBlock
from mode.model import MoDETransformer
from mode.train import train
from tests.tiny import TINY
from tests.tolerances import assert_close

D, H, E = 32, 4, 4


def test_staged_with_capacity_one_and_unit_gate_equals_moe_block():
    staged = StagedMoDEBlock(D, H, capacity=1.0, n_experts=E, top_k=2, gate="none")
    moe_block = MoEBlock(D, H, DroplessMoE(D, 2 * D, E, 2))
    moe_block.load_state_dict(staged.block.state_dict())
    x = torch.randn(2, 16, D)
    assert_close(staged(x), moe_block(x), "layer")


@pytest.mark.parametrize("top_k", [1, 2])
def test_skipping_tokens_never_reach_the_experts(top_k):
    staged = StagedMoDEBlock(D, H, capacity=0.25, n_experts=E, top_k=top_k)
    seen = []
    experts = staged.block.mlp.experts
    sorted_entry, scattered_entry = experts.forward_sorted, experts.forward_scattered

    def count_sorted(x, counts):  # rows computed: sorted rows, or assignments in token order
        seen.append(x.shape[0])
        return sorted_entry(x, counts)

    def count_scattered(x, counts, token_idx, *rest):
        seen.append(token_idx.numel())
        return scattered_entry(x, counts, token_idx, *rest)

    experts.forward_sorted, experts.forward_scattered = count_sorted, count_scattered
    B, T = 3, 16
    staged(torch.randn(B, T, D))
    assert seen == [B * 4 * top_k]  # k = 4 tokens per row, top_k experts each
    assert staged.block.mlp.metrics["dispatched"] == B * 4 * top_k


def test_integrated_without_noops_equals_moe_block():
    integ = IntegratedMoDEBlock(D, H, n_experts=E, n_noop=0, top_k=2)
    moe_block = MoEBlock(D, H, DroplessMoE(D, 2 * D, E, 2))
    moe_block.load_state_dict(integ.state_dict())
    x = torch.randn(2, 16, D)
    assert_close(integ(x), moe_block(x), "layer")


def test_token_routed_to_noop_is_bit_exact_after_the_mlp_residual():
    integ = IntegratedMoDEBlock(D, H, n_experts=E, n_noop=4, top_k=1)
    torch.nn.init.normal_(integ.mlp.router.weight, std=1.0)
    x = torch.randn(2, 16, D)
    out = integ(x)
    logits = integ.mlp.router(integ.norm2(x + integ.attn(integ.norm1(x)))).argmax(-1)
    noop = logits >= E
    assert 0 < noop.sum() < noop.numel()
    after_attn = x + integ.attn(integ.norm1(x))
    assert torch.equal(out[noop], after_attn[noop])  # no expert touched them: bit-exact
    assert not torch.equal(out[~noop], after_attn[~noop])
    assert integ.mlp.metrics["dispatched"] == int((~noop).sum())


@pytest.mark.parametrize("top_k", [1, 2])
def test_integrated_noop_share_is_reported(top_k):
    integ = IntegratedMoDEBlock(D, H, n_experts=E, n_noop=4, top_k=top_k)
    integ(torch.randn(2, 16, D))
    share = integ.mlp.metrics["noop_share"]
    assert 0 <= share <= 1
    assert integ.mlp.metrics["dispatched"] == round(2 * 16 * top_k * (1 - float(share)))


def test_gradients_reach_both_routers():
    staged = StagedMoDEBlock(D, H, capacity=0.5, n_experts=E, top_k=2)
    staged(torch.randn(2, 16, D)).pow(2).sum().backward()
    assert staged.router.weight.grad.abs().max() > 0
    assert staged.block.mlp.router.weight.grad.abs().max() > 0


PRESET_RUN = [*TINY, "train.batch_size=4", "train.steps=5", "train.eval_every=5"]


@pytest.mark.parametrize("preset", [p for p in preset_names() if p != "base"])
def test_every_preset_trains_saves_and_reloads(preset, tmp_path):
    cfg = load_config(preset, [*PRESET_RUN, f"train.out_dir={tmp_path}"])
    model, result = train(cfg)
    assert result.steps == 5 and torch.isfinite(torch.tensor(result.val_loss))
    reloaded = MoDETransformer(cfg.model)
    assert load_checkpoint(tmp_path / "ckpt.pt", reloaded) == 5
    model.eval()
    reloaded.eval()
    idx = torch.randint(0, 256, (2, 32))
    assert torch.equal(model(idx)[0], reloaded(idx)[0])


def test_model_layout_builds_the_public_block_classes():
    cfg = load_config(None, ["model.layout=mode_staged,mode_integrated", "model.n_layers=2", "model.moe.n_noop=2"])
    model = MoDETransformer(cfg.model)
    assert isinstance(model.blocks[0], StagedMoDEBlock)
    assert isinstance(model.blocks[1], IntegratedMoDEBlock)
    assert model.blocks[1].mlp.n_noop == 2
