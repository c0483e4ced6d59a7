"""A MoD model at sequence 8192 (batch 1, d_model 256) trains (forward + backward) and runs its
causal forward on CPU without any [T, T] tensor: a dispatch mode watches every op's output."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mode.config import load_config
from mode.model import MoDETransformer
from mode.routed import aux_loss

T = 8192


class LargestOutput(TorchDispatchMode):
    """Records the largest number of elements any op's output had."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), func
        return out


def test_mod_model_at_8192_tokens_never_builds_a_t_by_t_tensor():
    cfg = load_config(
        None,
        [
            "model.d_model=256",
            "model.n_heads=4",
            "model.n_layers=2",
            f"model.seq_len={T}",
            "model.layout=dense,mod",
            "model.mod.capacity=0.125",
            "model.mod.causal=predictor",
        ],
    ).model
    torch.manual_seed(0)
    model = MoDETransformer(cfg)
    idx = torch.randint(0, 256, (1, T))
    watch = LargestOutput()
    with watch:
        _, loss = model(idx, idx)
        (loss + aux_loss(model)).backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for n, p in model.named_parameters() if "blocks.1.block" in n)
    # The largest outputs are [T, 4 D] MLP activations (T^2 / 8 here); a [T, T] mask would be T^2.
    assert watch.largest < T * T // 4, (watch.largest, watch.op)
    model.eval()
    watch = LargestOutput()
    with watch, torch.no_grad():
        logits, _ = model(idx, routing="causal")
    assert torch.isfinite(logits).all()
    assert watch.largest < T * T // 4, (watch.largest, watch.op)
