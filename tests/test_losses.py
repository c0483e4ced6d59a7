import math

import pytest
import torch

from mode.experts.moe import DroplessMoE
from mode.routing.losses import load_balance_loss, router_z_loss, target_shares, update_selection_bias
from mode.routing.token_choice import token_choice_topk
from tests.tolerances import assert_close

LN3 = math.log(3.0)


def test_load_balance_loss_hand_computed():
    balanced = torch.tensor([[0.0, LN3], [LN3, 0.0]])  # probs [.25, .75] and [.75, .25]
    c = token_choice_topk(balanced, 1)
    assert c.experts.view(-1).tolist() == [1, 0]
    # f = [.5, .5], P = [.5, .5]: 2 * (.25 + .25) = 1
    assert load_balance_loss(c.probs, c.experts).item() == pytest.approx(1.0)
    skewed = torch.tensor([[0.0, LN3], [0.0, LN3]])
    c = token_choice_topk(skewed, 1)
    # f = [0, 1], P = [.25, .75]: 2 * .75 = 1.5
    assert load_balance_loss(c.probs, c.experts).item() == pytest.approx(1.5)
    # per sequence: mean of the two sequences' losses
    per_seq = load_balance_loss(
        torch.stack([torch.softmax(balanced, -1), torch.softmax(skewed, -1)]),
        torch.stack([torch.tensor([[1], [0]]), torch.tensor([[1], [1]])]),
    )
    assert per_seq.item() == pytest.approx((1.0 + 1.5) / 2)


def test_load_balance_with_noop_target():
    target = target_shares(2, 2, noop_share=0.5)
    assert target.tolist() == [0.25, 0.25, 0.25, 0.25]
    target = target_shares(2, 1, noop_share=0.5)  # real .25 each, one no-op .5
    probs = torch.tensor([[0.25, 0.25, 0.5]] * 4)
    experts = torch.tensor([[0], [1], [2], [2]])  # loads match the target: f = P = t
    assert load_balance_loss(probs, experts, target).item() == pytest.approx(1.0)


def test_z_loss_hand_computed():
    logits = torch.tensor([[0.0, LN3], [0.0, 0.0]])
    expected = (math.log(4.0) ** 2 + math.log(2.0) ** 2) / 2
    assert router_z_loss(logits).item() == pytest.approx(expected)


def test_renormalized_top2_weights():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    c = token_choice_topk(logits, 2, renormalize=True)
    assert c.experts.tolist() == [[0, 1]]
    assert_close(c.weights, torch.tensor([[0.625, 0.375]]), "elementwise")
    c = token_choice_topk(logits, 2, renormalize=False)
    assert_close(c.weights, torch.tensor([[0.5, 0.3]]), "elementwise")


def test_selection_bias_changes_choice_not_weights():
    logits = torch.log(torch.tensor([[0.6, 0.4]]))
    c = token_choice_topk(logits, 1, selection_bias=torch.tensor([0.0, 1.0]))
    assert c.experts.tolist() == [[1]]
    assert_close(c.weights, torch.tensor([[0.4]]), "elementwise")


def test_bias_update_rule():
    bias = torch.zeros(3)
    update_selection_bias(bias, torch.tensor([0.5, 0.3, 0.2]), rate=0.1)
    assert_close(bias, torch.tensor([-0.1, 0.1, 0.1]), "elementwise")  # sign(mean 1/3 - load)


def test_aux_loss_free_bias_balances_a_skewed_router():
    torch.manual_seed(0)
    layer = DroplessMoE(16, 32, 4, top_k=1, bias_rate=0.02, lb_coef=0.0).train()
    with torch.no_grad():
        layer.router.weight.normal_(std=0.1)
        layer.router.weight[0] += 0.3  # expert 0 is favoured by inputs with positive mean
    x = torch.randn(512, 16) + 0.5
    layer(x)
    before = layer.metrics["load"].clone()
    for _ in range(50):
        layer(x)
        layer.after_optimizer_step()
    after = layer.metrics["load"]
    assert before.max() > 0.5  # skewed to start with
    assert after.max() < before.max() - 0.2
    assert (after - 0.25).abs().max() < (before - 0.25).abs().max()
    assert layer.selection_bias.dtype == torch.float32
    assert "selection_bias" in layer.state_dict()  # saved in checkpoints
