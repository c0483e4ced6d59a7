"""The console scripts print a user's mistake as one message (the script's name, what is wrong
and the fix) with exit status 2, not a traceback; ``MODE_DEBUG=1`` shows the traceback. Run
as a user runs them: the installed scripts, in their own processes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow

MISTAKES = [
    ("mode-train", ["--config", "mdo"], "no config 'mdo'"),
    ("mode-train", ["--config", "dense", "model.n_layer=3"], "Did you mean: 'n_layers'"),
    ("mode-eval", ["missing/ckpt.pt"], "no checkpoint file at missing/ckpt.pt"),
    ("mode-export", ["missing/ckpt.pt", "out"], "no checkpoint file at missing/ckpt.pt"),
    ("mode-generate", ["missing/ckpt.pt"], "no checkpoint file at missing/ckpt.pt"),
    ("mode-prepare", ["missing.txt", "--out", "prepared"], "'missing.txt': no such text file"),
]


def run(script: str, args: list[str], cwd: Path, debug: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MODE_DEBUG"}
    if debug is not None:
        env["MODE_DEBUG"] = debug
    return subprocess.run([BIN / script, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


@pytest.mark.parametrize("script,args,words", MISTAKES, ids=[f"{s}-{a[-1]}" for s, a, _ in MISTAKES])
def test_a_users_mistake_is_one_message_not_a_traceback(script, args, words, tmp_path):
    got = run(script, args, tmp_path)
    assert got.returncode == 2, got
    assert "Traceback" not in got.stderr, got.stderr
    message = [line for line in got.stderr.splitlines() if line.startswith(f"{script}: ")]
    assert len(message) == 1 and words in message[0], got.stderr
    assert "MODE_DEBUG=1 shows the traceback" in got.stderr


def test_mode_debug_shows_the_traceback(tmp_path):
    got = run("mode-train", ["--config", "mdo"], tmp_path, debug="1")
    assert got.returncode == 1 and "Traceback" in got.stderr and "UnknownPresetError" in got.stderr, got.stderr
