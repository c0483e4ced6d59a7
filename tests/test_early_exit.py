"""Early exit (``mode.layers.early_exit``): the exit rule, its causality and exact KV decoding,
the per-layer exit loss, the compute share, configuration errors and FLOPs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mode.config import load_config
from mode.flops import model_flops
from mode.model import MoDETransformer
from mode.routed import aux_loss
from tests.tiny import TINY_MODEL
from tests.tolerances import assert_close

L = 4


def build(threshold: float = 0.9, min_layer: int = 1, loss_coef: float = 1.0) -> MoDETransformer:
    overrides = [
        *TINY_MODEL,
        f"model.n_layers={L}",
        f"model.early_exit.threshold={threshold}",
        f"model.early_exit.min_layer={min_layer}",
        f"model.early_exit.loss_coef={loss_coef}",
    ]
    torch.manual_seed(0)
    model = MoDETransformer(load_config("early_exit", overrides).model)
    with torch.no_grad():  # a sharper head than at init, so confidences spread over (0, 1)
        model.lm_head.weight.mul_(25.0)
    return model


def median_confidence(model: MoDETransformer, idx: torch.Tensor) -> float:
    """Halfway between the two middle top probabilities of the first exit head: a threshold
    that exits about half the tokens and sits away from every token's confidence (so rounding
    differences between a full forward and decoding cannot flip a decision at the first head)."""
    with torch.no_grad():
        x = model.blocks[0](model.tok_emb(idx))
        conf = torch.softmax(model.head(x).float(), -1).amax(-1).flatten().sort().values
        mid = conf.numel() // 2
        return float(conf[mid - 1] + conf[mid]) / 2


def mixed_model(idx: torch.Tensor) -> MoDETransformer:
    model = build()
    model.early_exit.threshold = median_confidence(model, idx)
    return model.eval()


def test_exited_tokens_keep_their_exit_state_and_others_run_every_block():
    idx = torch.randint(0, 256, (2, 24))
    model = mixed_model(idx)
    with torch.no_grad():
        logits, _ = model(idx)
        # Reference: a plain loop; a token keeps its state from the first confident exit head on.
        x, active = model.tok_emb(idx), torch.ones(idx.shape, dtype=torch.bool)
        for i, block in enumerate(model.blocks):
            x = torch.where(active.unsqueeze(-1), block(x), x)
            if i < L - 1:
                active &= ~model.early_exit.confident(model.head(x))
        expected = model.head(x)
    share = float(model.early_exit.metrics["compute_share"])
    assert 0.0 < float(model.early_exit.metrics["exit_share"]) < 1.0
    assert 1 / L < share < 1.0
    assert_close(logits, expected, "layer")


def test_threshold_sets_the_compute_share():
    idx = torch.randint(0, 256, (2, 16))
    for threshold, min_layer in ((0.0, 1), (0.0, 2), (0.0, 3)):  # every token exits after min_layer blocks
        model = build(threshold, min_layer).eval()
        with torch.no_grad():
            model(idx)
        assert float(model.early_exit.metrics["compute_share"]) == pytest.approx(min_layer / L)
        assert float(model.early_exit.metrics["exit_share"]) == pytest.approx(1.0)
    shares = []
    for threshold in (0.3, 0.6, 0.9, 1.0):  # a higher bar: fewer exits, more compute
        model = build(threshold).eval()
        with torch.no_grad():
            model(idx)
        shares.append(float(model.early_exit.metrics["compute_share"]))
    assert shares == sorted(shares) and shares[0] < shares[-1]


def test_early_exit_is_causal_and_its_kv_cache_decodes_exactly():
    idx = torch.randint(0, 256, (2, 24))
    model = mixed_model(idx)
    assert model.supports_causal()
    with torch.no_grad():
        full, _ = model(idx, routing="causal")
        changed = idx.clone()
        changed[:, 15:] = torch.randint(0, 256, (2, 9))
        assert torch.equal(model(changed, routing="causal")[0][:, :15], full[:, :15])
        caches = model.new_caches(2)
        prefill, _ = model(idx[:, :10], routing="causal", caches=caches)
        assert_close(prefill, full[:, :10], "layer")
        steps = [model.decode(idx[:, t : t + 1], t, caches) for t in range(10, 24)]
    assert_close(torch.stack(steps, 1), full[:, 10:], "layer")
    # Every block's cache holds every token (exited ones from their frozen state).
    assert all(int(c.lengths.min()) == 24 for c in caches)


def test_greedy_generation_with_and_without_the_cache_agree():
    idx = torch.randint(0, 256, (1, 8))
    model = mixed_model(idx)
    a = model.generate(idx, 12, temperature=0, use_cache=True)
    b = model.generate(idx, 12, temperature=0, use_cache=False)
    assert torch.equal(a, b)


def test_training_adds_the_mean_intermediate_exit_loss():
    model = build(loss_coef=0.5).train()
    idx, targets = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    _, loss = model(idx, targets)
    x, ces = model.tok_emb(idx), []
    for block in model.blocks:
        x = block(x)
        ces.append(F.cross_entropy(model.head(x).view(-1, 256), targets.view(-1)))
    assert_close(loss, ces[-1], "reduction")  # training runs every block on every token
    assert_close(aux_loss(model), 0.5 * torch.stack(ces[:-1]).mean(), "reduction")
    aux_loss(model).backward()
    assert model.blocks[0].attn.qkv.weight.grad.abs().max() > 0


def test_early_exit_config_errors_name_the_field():
    with pytest.raises(ValueError, match="model.early_exit.enabled"):
        load_config("early_exit", ["model.layout=dense,mod"])
    with pytest.raises(ValueError, match="model.early_exit.min_layer"):
        load_config("early_exit", [f"model.n_layers={L}", f"model.early_exit.min_layer={L}"])
    with pytest.raises(ValueError, match="model.early_exit.threshold"):
        load_config("early_exit", ["model.early_exit.threshold=1.5"])


def test_training_flops_count_every_exit_head():
    cfg = load_config("early_exit", [*TINY_MODEL, f"model.n_layers={L}"]).model
    dense = load_config("dense", [*TINY_MODEL, f"model.n_layers={L}"]).model
    head = 2 * cfg.seq_len * cfg.d_model * cfg.vocab_size
    assert model_flops(cfg) == model_flops(dense) + (L - 1) * head
