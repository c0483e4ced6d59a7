"""Interrupted training: a real SIGKILL of a training process at random moments (one of them
in the middle of a save, slowed down on purpose), then resume, equals training straight
through, bit for bit, for one process and for two (torchrun). The last good checkpoint always
loads."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mode.checkpoint import latest, load_checkpoint
from mode.config import load_config
from mode.model import MoDETransformer
from tests.tiny import TINY

pytestmark = pytest.mark.slow  # training runs in subprocesses, killed with SIGKILL

ROOT = Path(__file__).resolve().parent.parent
STEPS = 16
# Routing state that must resume too: the predictor's running threshold (MoD) and the
# aux-loss-free selection bias (MoE).
CFG = [
    *TINY,
    "model.layout=mod,moe",
    "model.mod.causal=predictor",
    "model.mod.capacity=0.25",
    "model.moe.bias_rate=0.01",
    "train.batch_size=4",
    f"train.steps={STEPS}",
    "train.ckpt_every=1",
    "train.keep_checkpoints=2",
    "train.eval_every=1000",
    "train.threads=1",
]
# The child slows every fsync of a checkpoint file down, so that kills land inside saves too.
CHILD = """
import os, stat, sys, time
real_fsync = os.fsync
def slow_fsync(fd):
    if not stat.S_ISDIR(os.fstat(fd).st_mode):  # a checkpoint file, before its rename
        time.sleep(float(os.environ.get("SLOW_SAVE", "0")))
    return real_fsync(fd)
os.fsync = slow_fsync
from mode.train import main
main(sys.argv[1:])
"""


def command(nproc: int, out: Path) -> list[str]:
    script = out.parent / "child.py"
    script.write_text(CHILD)
    if nproc == 1:
        return [sys.executable, str(script)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(script)]


def run(nproc: int, out: Path, extra: list[str], kill_after: float | None = None, slow: float = 0.0) -> int:
    """Run training to the end, or SIGKILL it and its workers ``kill_after`` seconds after its
    first checkpoint appears (< 0: inside the save after that). Returns the exit code (-9
    when killed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "SLOW_SAVE": str(slow)}
    args = [*CFG, f"train.out_dir={out}", *extra]
    if nproc > 1:
        args.append(f"parallel.dp_size={nproc}")
    proc = subprocess.Popen(
        [*command(nproc, out), *args],
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if kill_after is None:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[:6000]
        return 0
    ckpt = out / ("ckpt.pt" if nproc == 1 else "ckpt")
    deadline = time.time() + 300
    while latest(ckpt) is None and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    if kill_after < 0:  # inside the next save: once its temporary file is there
        tmp = ckpt.with_name(ckpt.name + ".tmp")
        while not tmp.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        kill_after = 0.05
    time.sleep(kill_after)
    # torchrun starts its workers in sessions of their own: kill the whole tree at once, as a
    # scheduler killing the job's cgroup would.
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)
    return proc.returncode


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out.extend(children)
            todo.extend(children)
    return out


def final_state(out: Path, nproc: int) -> dict:
    cfg = load_config(None, CFG).model
    model = MoDETransformer(cfg)
    assert load_checkpoint(out / ("ckpt.pt" if nproc == 1 else "ckpt"), model) == STEPS
    return model.state_dict()


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def check_kill_and_resume(tmp_path: Path, nproc: int, kills: list[tuple[float, float]]) -> None:
    straight = tmp_path / "straight"
    run(nproc, straight, [])
    reference = final_state(straight, nproc)
    for i, (after, slow) in enumerate(kills):
        out = tmp_path / f"killed{i}"
        code = run(nproc, out, [], kill_after=after, slow=slow)
        assert code == -signal.SIGKILL, code  # it was killed, not finished
        if slow >= 0.4 and nproc == 1:
            assert (out / "ckpt.pt.tmp").exists()  # killed inside a save
        resumable = latest(out / ("ckpt.pt" if nproc == 1 else "ckpt"))
        assert resumable is not None
        model = MoDETransformer(load_config(None, CFG).model)
        step = load_checkpoint(resumable, model)  # the last good checkpoint always loads
        assert 1 <= step < STEPS
        run(nproc, out, ["train.resume=true"])
        got = final_state(out, nproc)
        for name, value in reference.items():
            assert torch.equal(got[name], value), (i, name)
        resumed = losses(out)
        for s, loss in losses(straight).items():
            if s > step:
                assert resumed[s] == loss, (i, s)


def test_sigkill_and_resume_equals_straight_training(tmp_path):
    rng = random.Random(0)
    # Random moments (each checkpoint file's fsync sleeps 0.1 s, so the 16 steps outlast the
    # 0.6 s window whatever the machine's load), and one with 0.4 s fsyncs, so the kill lands
    # inside a save.
    kills = [(rng.uniform(0.05, 0.6), 0.1), (rng.uniform(0.05, 0.6), 0.1), (-1.0, 0.4)]
    check_kill_and_resume(tmp_path, 1, kills)


def test_sigkill_and_resume_with_two_processes(tmp_path):
    check_kill_and_resume(tmp_path, 2, [(random.Random(1).uniform(0.3, 1.5), 0.1)])


def test_keep_checkpoints_keeps_the_newest(tmp_path):
    run(1, tmp_path, ["train.steps=5"])
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt"))
    assert names == ["ckpt.pt", "ckpt.pt.step4"]
