"""A rank that dies: one of 4 gloo workers of a ``torchrun --max-restarts 1`` job is SIGKILLed
mid-run (after its first checkpoint). torchrun tears the other workers down, restarts the
job, which resumes from the last checkpoint, and ends with the same weights as a run that
was never interrupted, bit for bit."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mode.checkpoint import latest
from tests.test_resume import CFG, ROOT, descendants, final_state

pytestmark = pytest.mark.slow  # torchrun with a killed rank

NPROC = 4


def launch(out: Path, max_restarts: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [*CFG, f"train.out_dir={out}", f"parallel.dp_size={NPROC}", "train.resume=true", "parallel.timeout_s=60"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}"]
    cmd += [f"--max-restarts={max_restarts}", "-m", "mode.train", *args]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def worker_pid(agent: int, rank: int) -> int | None:
    """The pid of the training worker with ``RANK=rank`` under the torchrun agent."""
    for pid in descendants(agent):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    return None


@pytest.mark.slow
def test_a_killed_rank_restarts_the_job_and_it_ends_as_an_uninterrupted_run(tmp_path):
    straight = tmp_path / "straight"
    proc = launch(straight, max_restarts=0)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    reference = final_state(straight, NPROC)

    out = tmp_path / "killed"
    proc = launch(out, max_restarts=1)
    deadline = time.time() + 300
    while latest(out / "ckpt") is None and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    victim = worker_pid(proc.pid, 2)
    assert victim is not None and proc.poll() is None, "the job ended before a worker could be killed"
    time.sleep(0.2)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]  # restarted once and finished
    assert "exitcode: -9" in err, err[-4000:]  # the agent saw the killed worker (and, exit 0: restarted the job)
    assert time.time() - killed_at < 300
    got = final_state(out, NPROC)
    for name, value in reference.items():
        assert torch.equal(got[name], value), name
