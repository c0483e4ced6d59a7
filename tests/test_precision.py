"""bf16 mixed precision: autocast forward, fp32 weights and optimizer state, fp32 routing and
losses; ``auto`` picks bf16 only where a measured bf16 matmul is faster."""

import json

import pytest
import torch

import mode
from mode.config import load_config
from mode.precision import BF16_MIN_SPEEDUP, bf16_speedup, resolve
from mode.train import train
from tests.tolerances import assert_close

D = 32


def test_auto_resolves_by_the_measured_speedup():
    expected = "bf16" if bf16_speedup("cpu") >= BF16_MIN_SPEEDUP else "fp32"
    assert resolve("auto", "cpu") == expected
    assert resolve("fp32") == "fp32" and resolve("bf16") == "bf16"
    with pytest.raises(ValueError, match="precision='fp16'"):
        resolve("fp16")
    with pytest.raises(ValueError, match="train.precision"):
        load_config(None, ["train.precision=half"])


@pytest.mark.parametrize("backend", ["torch", "chunked", "loop"])
def test_experts_compute_in_bf16_under_autocast_and_match_fp32(backend):
    torch.manual_seed(0)
    layer = mode.DroplessMoE(D, 64, 4, backend=backend)
    x = torch.randn(64, D)
    ref = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        logits = layer.router_logits(x)
    assert out.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert_close(out, ref, "layer")
    out.float().sum().backward()
    assert layer.experts.w1.grad.dtype == torch.float32


def test_bf16_training_keeps_fp32_weights_and_learns(tmp_path):
    cfg = load_config(
        None,
        [
            "model.d_model=64",
            "model.n_heads=4",
            "model.n_layers=2",
            "model.seq_len=64",
            "model.layout=mod,moe",
            "model.moe.n_experts=4",
            "train.batch_size=8",
            "train.steps=30",
            "train.eval_every=30",
            "train.eval_batches=2",
            "train.log_every=1",
            "train.progress=false",
            "train.lr=3e-3",
            "train.warmup_steps=5",
            "train.precision=bf16",
            f"train.out_dir={tmp_path}",
        ],
    )
    model, result = train(cfg)
    assert result.precision == "bf16"
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0] - 1.0
    assert all(p.dtype == torch.float32 for p in model.parameters())
    state = torch.load(tmp_path / "ckpt.pt", weights_only=False)["optimizer"]["state"]
    assert all(s["exp_avg"].dtype == torch.float32 for s in state.values())
