"""The table of block kinds agrees with the blocks it builds, and the presets ship in the wheel."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from mode.config import load_config, preset_names
from mode.experts.moe import MoELayer
from mode.layers.kinds import BLOCK_KINDS, build_block
from mode.layers.mod import MoDBlock
from tests.tiny import TINY_MODEL

ROOT = Path(__file__).resolve().parent.parent
SMALL = [*TINY_MODEL, "model.seq_len=16"]
VARIANTS = [[], ["model.mod.causal=predictor"], ["model.moe.router=expert_choice"]]


@pytest.mark.parametrize("extra", VARIANTS, ids=["default", "predictor", "expert_choice"])
@pytest.mark.parametrize("kind", list(BLOCK_KINDS))
def test_each_entry_describes_the_block_it_builds(kind, extra):
    cfg = load_config(None, [*SMALL, *extra]).model
    block = build_block(kind, cfg)
    entry = BLOCK_KINDS[kind]
    assert entry.holds_experts == any(isinstance(m, MoELayer) for m in block.modules())
    assert entry.routes_depth == any(isinstance(m, MoDBlock) for m in block.modules())
    # no-op experts: built from options that ask for 2 of them (valid with an integrated layer
    # and a token-choice router)
    if extra != ["model.moe.router=expert_choice"]:
        noop_cfg = load_config(None, [*SMALL, *extra, "model.layout=mode_integrated", "model.moe.n_noop=2"]).model
        noops = [m.n_noop for m in build_block(kind, noop_cfg).modules() if isinstance(m, MoELayer)]
        assert entry.has_noop_experts == (noops == [2]), noops
    y = block(torch.randn(2, cfg.seq_len, cfg.d_model))
    assert y.shape == (2, cfg.seq_len, cfg.d_model)


def test_every_kind_has_a_preset_of_its_name():
    assert set(BLOCK_KINDS) <= set(preset_names())


def test_unknown_kind_suggests_the_closest():
    with pytest.raises(ValueError, match="did you mean 'mode_staged'"):
        load_config(None, ["model.layout=dense,mode_stagde"])


@pytest.mark.slow
def test_presets_load_from_a_built_wheel(tmp_path):
    """``load_config("<preset>")`` works from a plain (non-editable) install: the presets are
    package data. The wheel is built here and its copy of ``mode`` imported instead of the clone."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheel = next(tmp_path.glob("mode_moe-*.whl"))
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        zf.extractall(site)
    assert {f"mode/configs/{p}.yaml" for p in preset_names()} <= set(names)
    script = (
        "import mode, mode.config as c; "
        f"assert mode.__file__.startswith({str(site)!r}), mode.__file__; "
        "names = c.preset_names(); "
        "[mode.MoDETransformer(c.load_config(n).model) for n in names]; print(len(names))"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert int(run.stdout.strip()) == len(preset_names())
