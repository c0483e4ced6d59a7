"""A run can always save again (``train.keep_checkpoints > 1``): after a real SIGKILL between a
save's history link and its rename, after a truncated latest checkpoint, after a flipped byte
in it, and, under torchrun with 2 gloo ranks, after a SIGKILL between the two renames of a
sharded save. Each: resume, save twice, resume again; a damaged checkpoint is moved aside as
``*.corrupt`` and said so."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mode import checkpoint
from mode.checkpoint import CheckpointDamagedError
from mode.config import load_config
from mode.model import MoDETransformer
from tests.test_checkpoint_safety import flip_a_byte
from tests.tiny import TINY, TINY_MODEL

ROOT = Path(__file__).resolve().parent.parent
CFG = [*TINY, "model.layout=mod,dense", "train.ckpt_every=1", "train.keep_checkpoints=3", "train.threads=1"]
# The child SIGKILLs itself (rank 0 under torchrun) right after a named os function has been
# called for the KILL_AT_CALL-th time with a source path that matches the regex KILL_SRC.
CHILD = """
import os, re, signal, sys
name, src, at = os.environ.get("KILL_FN"), os.environ.get("KILL_SRC", ""), int(os.environ.get("KILL_AT_CALL", "0"))
rank0 = os.environ.get("RANK", "0") == "0"
if name and rank0:
    real, calls = getattr(os, name), [0]
    def killing(a, b, *args, **kwargs):
        out = real(a, b, *args, **kwargs)
        if re.search(src, str(a)):
            calls[0] += 1
            if calls[0] == at:
                os.killpg(os.getpgid(0), signal.SIGKILL)
        return out
    setattr(os, name, killing)
from mode.train import main
main(sys.argv[1:])
"""


def train(out: Path, steps: int, nproc: int = 1, resume: bool = False, **kill) -> subprocess.CompletedProcess:
    script = out.parent / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **{k: str(v) for k, v in kill.items()}}
    args = [*CFG, f"train.steps={steps}", f"train.out_dir={out}", f"train.resume={str(resume).lower()}"]
    if nproc == 1:
        cmd = [sys.executable, str(script)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        cmd.append(str(script))
        args.append(f"parallel.dp_size={nproc}")
    return subprocess.run(
        [*cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, start_new_session=True
    )


def resumes_and_saves_again(out: Path, killed_at: int, nproc: int = 1) -> str:
    """Resume to ``killed_at + 2`` (two saves), then resume again to ``killed_at + 4``; the
    final checkpoint is at that step. Returns the first resume's output."""
    first = train(out, killed_at + 2, nproc, resume=True)
    assert first.returncode == 0, first.stderr[-4000:]
    again = train(out, killed_at + 4, nproc, resume=True)
    assert again.returncode == 0, again.stderr[-4000:]
    ckpt = out / ("ckpt.pt" if nproc == 1 else "ckpt")
    model = MoDETransformer(load_config(None, CFG).model)
    assert checkpoint.load(ckpt, model).step == killed_at + 4
    return first.stdout + first.stderr


KILLS = {
    # The 3rd save hard-links ckpt.pt (step 2) to a temporary name, then is killed.
    "after the link": dict(KILL_FN="link", KILL_SRC=r"ckpt\.pt$", KILL_AT_CALL=2),
    # ... or after renaming that link to ckpt.pt.step2, before the rename of the new file:
    # ckpt.pt and ckpt.pt.step2 are then one file, the state that broke the next save.
    "before the rename": dict(KILL_FN="replace", KILL_SRC=r"ckpt\.pt\.link\d+$", KILL_AT_CALL=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("when", list(KILLS), ids=list(KILLS))
def test_a_sigkill_inside_a_save(tmp_path, when):
    out = tmp_path / "run"
    killed = train(out, 6, **KILLS[when])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    if when == "before the rename":
        assert os.path.samefile(out / "ckpt.pt", out / "ckpt.pt.step2")
    else:
        assert list(out.glob("ckpt.pt.link*"))
    resumes_and_saves_again(out, 2)
    assert not list(out.glob("ckpt.pt.link*"))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "flipped byte"])
def test_a_damaged_latest_checkpoint(tmp_path, damage):
    out = tmp_path / "run"
    assert train(out, 4).returncode == 0
    latest = out / "ckpt.pt"
    if damage == "truncated":
        latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])
    else:
        flip_a_byte(latest)
    said = resumes_and_saves_again(out, 3)
    assert "moved aside to ckpt.pt.corrupt" in said
    assert (out / "ckpt.pt.corrupt").exists()


@pytest.mark.slow
def test_a_sigkill_inside_a_sharded_save_under_torchrun(tmp_path):
    out = tmp_path / "run"
    # Rank 0's 3rd save moves ckpt/ (step 2) aside as ckpt.step2 and is killed before it renames
    # ckpt.tmp/ in: no ckpt/ at all, the newest complete directory is the history one.
    killed = train(out, 6, nproc=2, KILL_FN="replace", KILL_SRC=r"/ckpt$", KILL_AT_CALL=2)
    assert killed.returncode != 0
    assert not (out / "ckpt").exists() and (out / "ckpt.step2").is_dir()
    resumes_and_saves_again(out, 2, nproc=2)


# -- the same without a subprocess: what save and load_newest_good do ----------------------------
@pytest.fixture
def model():
    torch.manual_seed(0)
    return MoDETransformer(load_config("mod", TINY_MODEL).model)


def saved(path: Path, model: MoDETransformer, steps: range, keep: int = 3) -> None:
    for step in steps:
        checkpoint.save(path, model, progress=checkpoint.Progress(step), keep=keep, warn=lambda _: None)


def test_a_damaged_latest_is_moved_aside_on_resume_and_saving_goes_on(tmp_path, model):
    path = tmp_path / "ckpt.pt"
    saved(path, model, range(1, 4))
    path.write_bytes(path.read_bytes()[:100])
    said = []
    found, progress = checkpoint.load_newest_good(path, model, warn=said.append)
    assert progress.step == 2 and found.name == "ckpt.pt.step2"
    assert len(said) == 1 and "moved aside to ckpt.pt.corrupt" in said[0]
    assert (tmp_path / "ckpt.pt.corrupt").stat().st_size == 100  # kept as it was, not deleted
    saved(path, model, range(3, 5))
    assert checkpoint.load(path, model).step == 4
    assert checkpoint.load(tmp_path / "ckpt.pt.step3", model).step == 3


def test_saving_over_an_unreadable_latest_moves_it_aside(tmp_path, model):
    """Without a resume in between (a file damaged while the run goes on), save still works."""
    path = tmp_path / "ckpt.pt"
    saved(path, model, range(1, 3))
    path.write_bytes(b"not a checkpoint")
    said = []
    checkpoint.save(path, model, progress=checkpoint.Progress(3), keep=3, warn=said.append)
    assert checkpoint.load(path, model).step == 3
    assert (tmp_path / "ckpt.pt.corrupt").read_bytes() == b"not a checkpoint"
    assert "moved aside" in said[0]


def test_a_taken_history_name_is_replaced(tmp_path, model):
    path = tmp_path / "ckpt.pt"
    saved(path, model, range(1, 3))  # ckpt.pt at step 2, ckpt.pt.step1
    (tmp_path / "ckpt.pt.step2").write_bytes(b"stale")
    saved(path, model, range(3, 4))
    assert checkpoint.load(tmp_path / "ckpt.pt.step2", model).step == 2
    assert not list(tmp_path.glob("*.link*"))


def test_a_leftover_tmp_link_is_never_written_through(tmp_path, model):
    path = tmp_path / "ckpt.pt"
    victim = tmp_path / "victim"
    victim.write_text("the user's file")
    (tmp_path / "ckpt.pt.tmp").symlink_to(victim)
    saved(path, model, range(1, 2))
    assert victim.read_text() == "the user's file"
    assert checkpoint.load(path, model).step == 1


def test_damage_is_named_as_such(tmp_path, model):
    path = tmp_path / "ckpt.pt"
    saved(path, model, range(1, 2))
    flip_a_byte(path)
    with pytest.raises(CheckpointDamagedError):
        checkpoint.load(path, model)
