import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mode.config import load_config
from mode.flops import block_flops, model_flops
from mode.model import MoDETransformer, build_block

REL_TOL = 0.05


def counted_flops(fn) -> int:
    # NOTE: the CPU flash kernel has no flop formula; the math backend runs real bmm's that are counted.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


BLOCK_CASES = [
    ("dense", []),
    ("mod", ["model.mod.capacity=0.125"]),
    ("mod", ["model.mod.capacity=0.5"]),
    ("moe", ["model.moe.backend=torch"]),
    ("moe", ["model.moe.backend=loop", "model.moe.top_k=1", "model.moe.mlp=swiglu"]),
    ("moe_capacity", ["model.moe.capacity_factor=1.25"]),
    (
        "moe",
        [
            "model.moe.backend=torch",
            "model.moe.shared_expert=true",
            "model.moe.shared_d_ff=96",
            "model.moe.shared_gate=true",
        ],
    ),
    ("mode_staged", ["model.mod.capacity=0.25"]),
]


@pytest.mark.parametrize("kind,overrides", BLOCK_CASES, ids=[f"{k}-{o}" for k, o in BLOCK_CASES])
def test_block_flops_match_counter(kind, overrides):
    cfg = load_config(None, ["model.d_model=64", "model.n_heads=4", "model.seq_len=128", *overrides]).model
    block = build_block(kind, cfg)
    x = torch.randn(2, cfg.seq_len, cfg.d_model)
    measured = counted_flops(lambda: block(x)) / 2
    assert measured == pytest.approx(block_flops(kind, cfg), rel=REL_TOL)


# mode_integrated's FLOPs depend on the realised no-op share: see the block test below.
@pytest.mark.parametrize("preset", ["dense", "mod", "moe", "moe_capacity", "mode_staged"])
def test_model_flops_match_counter(preset):
    cfg = load_config(preset, ["model.d_model=64", "model.n_heads=4", "model.seq_len=128"]).model
    model = MoDETransformer(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    measured = counted_flops(lambda: model(idx)) / 2
    assert measured == pytest.approx(model_flops(cfg), rel=REL_TOL)


def test_early_exit_training_flops_match_counter():
    """Training with targets runs every block and every exit head on every token."""
    cfg = load_config("early_exit", ["model.d_model=64", "model.n_heads=4", "model.seq_len=128"]).model
    model = MoDETransformer(cfg).train()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    measured = counted_flops(lambda: model(idx, idx)) / 2
    assert measured == pytest.approx(model_flops(cfg), rel=REL_TOL)


def test_mod_costs_k_squared_attention():
    cfg = load_config("mod", ["model.d_model=512", "model.n_heads=8", "model.seq_len=1024"]).model
    ratio = block_flops("mod", cfg) / block_flops("dense", cfg)
    assert 0.09 < ratio < 0.12  # about 0.10 at this size: attention over k tokens costs k^2


def test_integrated_flops_match_counter_at_the_realised_noop_share():
    cfg = load_config(
        None,
        ["model.d_model=64", "model.n_heads=4", "model.seq_len=128", "model.layout=mode_integrated"]
        + ["model.moe.n_noop=4", "model.moe.top_k=1"]
        # NOTE: the loop backend multiplies each expert's own rows, so the counter sees the
        # FLOPs done; grouped_mm's shape is the static N*K + 1 buffer, whose rows past the
        # experts' it skips but a shape-based counter cannot.
        + ["model.moe.backend=loop"],
    ).model
    block = build_block("mode_integrated", cfg)
    x = torch.randn(2, cfg.seq_len, cfg.d_model)
    measured = counted_flops(lambda: block(x)) / 2
    share = block.mlp.metrics["noop_share"].item()
    assert 0 < share < 1
    cfg.moe.noop_share = share
    assert measured == pytest.approx(block_flops("mode_integrated", cfg), rel=REL_TOL)


@pytest.mark.parametrize("kind,overrides", [("dense", []), ("mod", ["model.mod.capacity=0.25"])])
def test_unmasked_flops_drop_exactly_the_causal_masked_pairs(kind, overrides):
    cfg = load_config(None, ["model.d_model=64", "model.n_heads=4", "model.seq_len=128", *overrides]).model
    block = build_block(kind, cfg)
    x = torch.randn(1, cfg.seq_len, cfg.d_model)
    measured = counted_flops(lambda: block(x))  # one sequence, forward, full score matrices
    n = cfg.seq_len if kind == "dense" else round(cfg.mod.capacity * cfg.seq_len)
    masked_pairs = int((~torch.ones(n, n, dtype=torch.bool).tril()).sum())  # query-key pairs the mask drops
    expected = measured - 4 * cfg.d_model * masked_pairs  # 2 FLOPs per MAC, in QK^T and in AV
    assert block_flops(kind, cfg, masked=False) == pytest.approx(expected, rel=REL_TOL)
    assert block_flops(kind, cfg, masked=False) < block_flops(kind, cfg)
