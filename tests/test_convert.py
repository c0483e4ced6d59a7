"""Upcycling a trained dense model into MoD, MoE and MoDE (``mode.convert``), and training
from the converted weights (``train.init_from`` / ``mode-train --init-from``)."""

import json
import math
from pathlib import Path

import pytest
import torch

from mode.config import load_config
from mode.convert import upcycle
from mode.layers.mod import MoDBlock
from mode.model import MoDETransformer
from mode.train import main, train
from tests.dist_utils import run_workers
from tests.tiny import TINY_MODEL
from tests.tolerances import assert_close

SMALL = TINY_MODEL
RUN = ["train.batch_size=4", "train.max_seconds=0", "train.eval_batches=1", "train.progress=false", "train.log_every=1"]
ONE_EXPERT = ["model.moe.n_experts=1", "model.moe.top_k=1", "model.moe.d_ff=128"]
IDX = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dense")
    cfg = load_config("dense", [*SMALL, *RUN, "train.steps=20", "train.eval_every=20", f"train.out_dir={out}"])
    train(cfg)
    return out / "ckpt.pt"


def dense_logits(path: Path) -> torch.Tensor:
    from mode.checkpoint import checkpoint_config, load_checkpoint

    model = MoDETransformer(checkpoint_config(path).model).eval()
    load_checkpoint(path, model)
    with torch.no_grad():
        return model(IDX)[0]


@pytest.mark.parametrize(
    "preset, extra",
    [
        ("mod", ["model.mod.capacity=1.0", "model.mod.gate=none"]),  # every token routed, unit gate
        ("moe", ONE_EXPERT),  # one expert equal to the dense MLP, top-1 (probability 1)
        ("mode_staged", ["model.mod.capacity=1.0", "model.mod.gate=none", *ONE_EXPERT]),
    ],
)
def test_conversion_that_keeps_the_function_gives_the_dense_logits(dense_ckpt, preset, extra):
    model = upcycle(dense_ckpt, load_config(preset, [*SMALL, *extra])).eval()
    with torch.no_grad():
        got = model(IDX)[0]
    assert_close(got, dense_logits(dense_ckpt), "layer")


def test_sliced_experts_compute_the_dense_mlp_when_a_token_takes_one_slice_each(dense_ckpt):
    """d_ff = hidden / top_k: experts 0 and 1 hold the two halves of the dense MLP, scaled by 2;
    a token sent to both with weights 1/2 each computes the dense MLP exactly."""
    model = upcycle(dense_ckpt, load_config("moe", SMALL))
    moe = model.blocks[1].mlp
    dense = MoDETransformer(load_config("dense", SMALL).model)
    from mode.checkpoint import load_checkpoint

    load_checkpoint(dense_ckpt, dense)
    x = torch.randn(5, 32)
    counts = torch.tensor([5])
    halves = sum(0.5 * moe.experts.forward_sorted(x, counts.new_tensor([5, 0, 0, 0]).roll(e)) for e in (0, 1))
    assert_close(halves, dense.blocks[1].mlp(x), "layer")


@pytest.mark.parametrize("preset", ["mod", "moe", "moe_capacity", "mode_staged", "mode_integrated"])
def test_every_target_preset_converts_deterministically_and_trains(dense_ckpt, preset, tmp_path):
    cfg = load_config(preset, [*SMALL, *RUN, "train.steps=5", "train.eval_every=5", f"train.out_dir={tmp_path}"])
    a, b = upcycle(dense_ckpt, cfg, seed=3), upcycle(dense_ckpt, cfg, seed=3)
    c = upcycle(dense_ckpt, cfg, seed=4)
    for (name, va), vb, vc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(va, vb), name
        if "router.weight" in name:
            assert not torch.equal(va, vc), name  # the seed is what decides
    cfg.train.init_from = str(dense_ckpt)
    _, result = train(cfg)
    assert result.steps == 5 and math.isfinite(result.val_loss)
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["init_from"] == str(dense_ckpt.resolve())


def test_mod_conversion_starts_with_the_gate_near_one_and_no_positional_preference(dense_ckpt):
    model = upcycle(dense_ckpt, load_config("mod", SMALL))
    block = next(b for b in model.blocks if isinstance(b, MoDBlock))
    assert torch.sigmoid(block.router.bias).item() == pytest.approx(0.95)
    model.train()
    with torch.no_grad():
        model(torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(1)))
    share = block.metrics["position_share"]
    assert share.max() < 0.5  # picks spread over the positions, not piled on the first tokens


@pytest.mark.parametrize(
    "override, field",
    [
        ("model.d_model=64", "model.d_model"),
        ("model.n_heads=2", "model.n_heads"),
        ("model.vocab_size=300", "model.vocab_size"),
        ("model.n_layers=4", "model.n_layers"),
        ("model.moe.d_ff=48", "model.moe.d_ff"),
        ("model.moe.mlp=swiglu", "model.moe.mlp"),
        ("model.qk_norm=true", "model.qk_norm"),  # an MoE block would keep fresh norms in silence
    ],
)
def test_a_target_that_does_not_fit_names_the_field(dense_ckpt, override, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        upcycle(dense_ckpt, load_config("mode_staged", [*SMALL, override]))


def test_only_dense_models_convert_and_missing_paths_say_so(dense_ckpt, tmp_path):
    mod_dir = tmp_path / "mod"
    train(load_config("mod", [*SMALL, *RUN, "train.steps=1", "train.eval_every=1", f"train.out_dir={mod_dir}"]))
    with pytest.raises(ValueError, match="dense model"):
        upcycle(mod_dir / "ckpt.pt", load_config("mod", SMALL))
    with pytest.raises(FileNotFoundError, match="init-from"):
        upcycle(tmp_path / "nope.pt", load_config("mod", SMALL))


def test_cli_init_from(dense_ckpt, tmp_path, capsys):
    main(
        [
            "--config",
            "mod",
            "--init-from",
            str(dense_ckpt),
            *SMALL,
            *RUN,
            "train.steps=2",
            "train.eval_every=2",
            f"train.out_dir={tmp_path}",
        ]
    )
    assert "2 steps" in capsys.readouterr().out
    assert json.loads((tmp_path / "run_info.json").read_text())["init_from"] == str(dense_ckpt.resolve())


def ep_init_worker(rank, world, dense_ckpt, out):
    cfg = load_config(
        "moe",
        [
            *SMALL,
            *RUN,
            "train.steps=3",
            "train.eval_every=3",
            "parallel.ep_size=2",
            f"train.out_dir={out}",
            f"train.init_from={dense_ckpt}",
        ],
    )
    train(cfg)


@pytest.mark.slow
def test_init_from_on_an_expert_parallel_launch_equals_one_process(dense_ckpt, tmp_path):
    run_workers(ep_init_worker, 2, str(dense_ckpt), str(tmp_path / "ep"))
    cfg = load_config(
        "moe",
        [
            *SMALL,
            *RUN,
            "train.steps=3",
            "train.eval_every=3",
            f"train.out_dir={tmp_path / 'one'}",
            f"train.init_from={dense_ckpt}",
        ],
    )
    train(cfg)

    def losses(d):
        return [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]

    for a, b in zip(losses(tmp_path / "ep"), losses(tmp_path / "one"), strict=True):
        assert abs(a - b) < 1e-4
