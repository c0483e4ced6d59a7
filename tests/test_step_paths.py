"""The training-step paths a default run skips: gradient accumulation of 2, 3 and 4 (the
gradient of one batch, by the model's own forward and backward), unlogged steps (the same
auxiliary losses and gradients as logged ones; a run logging every third step ends with the
weights of one logging every step), and a skipped step with routing state (the predictor's
threshold and the aux-loss-free biases do not move)."""

import copy

import pytest
import torch

from mode import aux_loss
from mode.checkpoint import load_checkpoint
from mode.config import load_config
from mode.model import MoDETransformer
from mode.step import train_step
from mode.train import train
from tests.tiny import TINY, TINY_MODEL

ROUTED = ["model.mod.causal=predictor", "model.moe.bias_rate=0.01", "model.moe.z_coef=0.001"]


def built(preset: str, *extra: str) -> MoDETransformer:
    torch.manual_seed(0)
    return MoDETransformer(load_config(preset, [*TINY_MODEL, *ROUTED, *extra]).model)


def batch(rows: int, seq: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (rows, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def sgd_gradient(model: MoDETransformer, x, y, **step) -> dict[str, torch.Tensor]:
    """The gradient ``train_step`` applied, read back from one plain SGD step of rate 1."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    train_step(model, opt, x, y, grad_clip=0.0, **step)
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("preset", ["dense", "mod"])
@pytest.mark.parametrize("accum", [2, 3, 4])
def test_accumulation_applies_the_gradient_of_the_whole_batch(preset, accum):
    model = built(preset)
    x, y = batch(12)
    reference = copy.deepcopy(model)
    _, loss = reference(x, y)
    (loss + aux_loss(reference)).backward()
    got = sgd_gradient(model, x, y, accum_steps=accum)
    for name, p in reference.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-6, msg=f"{name}, accum {accum}")


@pytest.mark.parametrize("preset", ["mod", "moe", "mode_staged", "mode_integrated"])
def test_an_unlogged_step_trains_with_the_same_auxiliary_losses(preset):
    logged, unlogged = built(preset), built(preset)
    x, y = batch(4)
    opt_a = torch.optim.SGD(logged.parameters(), lr=1.0)
    opt_b = torch.optim.SGD(unlogged.parameters(), lr=1.0)
    a = train_step(logged, opt_a, x, y, metrics=True)
    b = train_step(unlogged, opt_b, x, y, metrics=False)
    assert float(a.aux) > 0, "the preset has auxiliary losses"
    torch.testing.assert_close(b.aux, a.aux, rtol=1e-6, atol=0)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=0)
    for (name, p), q in zip(logged.state_dict().items(), unlogged.state_dict().values(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_a_run_logging_every_third_step_ends_with_the_same_weights(tmp_path):
    run = [*TINY, *ROUTED, "model.layout=mod,mode_staged", "train.steps=6", "train.eval_every=6"]
    finals = []
    for every in (1, 3):
        out = tmp_path / f"log{every}"
        train(load_config("mod", [*run, f"train.log_every={every}", f"train.out_dir={out}"]))
        model = MoDETransformer(load_config("mod", run).model)
        assert load_checkpoint(out / "ckpt.pt", model) == 6
        finals.append(model.state_dict())
    for name, value in finals[0].items():
        torch.testing.assert_close(finals[1][name], value, rtol=1e-5, atol=1e-7, msg=name)


def test_a_skipped_step_moves_no_routing_state():
    """A NaN gradient (the forward is finite and records routing state as usual) skips the
    step: the predictor's threshold and the experts' selection biases stay where they were."""
    model = built("mode_staged")
    x, y = batch(4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    train_step(model, opt, x, y, grad_clip=1.0)  # a normal step: the state has moved once
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    moving = [n for n in buffers if "threshold" in n or "bias" in n]
    assert moving, sorted(buffers)
    poisoned = next(p for n, p in model.named_parameters() if "experts" in n)
    hook = poisoned.register_hook(lambda g: g * float("nan"))
    out = train_step(model, opt, x, y, grad_clip=1.0)
    hook.remove()
    assert bool(out.skipped)
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), name
    train_step(model, opt, x, y, grad_clip=1.0)  # the next good step moves it again
    assert any(not torch.equal(dict(model.named_buffers())[n], buffers[n]) for n in moving)
