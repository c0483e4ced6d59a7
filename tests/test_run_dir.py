"""An operator's files are never lost: a second run into a directory holding a run is refused
(``train.resume`` / ``train.overwrite``), a live run's directory is locked (the second run
names the first's pid and host), links planted under the run's file names are never written
through, a resume with nothing to resume says so, and ``mode-prepare`` removes only the files
its own ``meta.json`` lists."""

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mode.config import load_config
from mode.data import load_corpus
from mode.prepare import prepare
from mode.run_dir import LOCK, RunDirectoryError
from mode.train import train
from tests.tiny import TINY

ROOT = Path(__file__).resolve().parent.parent
RUN = [*TINY, "model.layout=dense,dense", "train.steps=2", "train.eval_every=2"]


def config(out: Path, *extra: str):
    return load_config("dense", [*RUN, f"train.out_dir={out}", *extra])


def test_a_second_run_into_a_run_directory_is_refused_and_loses_nothing(tmp_path):
    train(config(tmp_path))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(RunDirectoryError, match="train.resume=true.*train.overwrite=true") as info:
        train(config(tmp_path))
    assert str(tmp_path) in str(info.value) and "ckpt.pt" in str(info.value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    assert not (tmp_path / LOCK).exists()  # the refused run gave the lock back


def test_overwrite_replaces_the_run_and_nothing_else(tmp_path):
    train(config(tmp_path, "train.steps=3", "train.ckpt_every=1", "train.keep_checkpoints=3"))
    assert (tmp_path / "ckpt.pt.step2").exists()
    (tmp_path / "notes.txt").write_text("mine")
    train(config(tmp_path, "train.overwrite=true"))
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert not list(tmp_path.glob("ckpt.pt.step*"))  # the earlier run's history is gone with it
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_resume_and_overwrite_together_are_refused():
    with pytest.raises(ValueError, match="train.overwrite"):
        load_config("dense", ["train.resume=true", "train.overwrite=true"])


def test_resume_with_no_checkpoint_says_so_in_the_first_line(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="mode"):
        train(config(tmp_path, "train.resume=true", "train.progress=true"))
    first = next(r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert "train.resume=true, but" in first and "no checkpoint" in first and "step 0" in first


def test_a_resumed_run_names_its_checkpoint_in_the_first_line(tmp_path, caplog):
    train(config(tmp_path))
    with caplog.at_level(logging.INFO, logger="mode"):
        train(config(tmp_path, "train.resume=true", "train.steps=3", "train.progress=true"))
    first = next(r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert "resumed from" in first and "ckpt.pt at step 2" in first


def test_a_live_run_locks_its_directory(tmp_path):
    """A real training process holds the directory; a second run is refused naming its pid."""
    out = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "mode.train", "--config", "dense", *RUN, "train.steps=100000", f"train.out_dir={out}"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").exists() and time.time() < deadline and first.poll() is None:
            time.sleep(0.1)
        assert (out / LOCK).exists(), "the first run never started"
        with pytest.raises(RunDirectoryError, match=f"pid {first.pid} on {socket.gethostname()}"):
            train(config(out, "train.resume=true"))
    finally:
        first.kill()
        first.wait()


def test_a_stale_lock_is_taken_over_and_said(tmp_path, caplog):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK).write_text(json.dumps({"pid": int(gone.stdout), "host": socket.gethostname()}))
    with caplog.at_level(logging.WARNING, logger="mode"):
        train(config(tmp_path))
    assert any("stale lock" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / LOCK).exists()


def test_links_planted_under_the_run_files_are_never_written_through(tmp_path):
    out = tmp_path / "run"
    train(config(out))
    victims = {}
    for name in ("metrics.jsonl", "config.json", "run_info.json", "ckpt.pt.tmp"):
        victim = tmp_path / f"victim-{name}"
        victim.write_text("the user's file")
        target = out / name
        target.unlink(missing_ok=True)
        target.symlink_to(victim)
        victims[name] = victim
    # config.json, run_info.json and the checkpoint's temporary file are replaced, not followed;
    # continuing metrics.jsonl through a link is refused.
    with pytest.raises(RunDirectoryError, match="metrics.jsonl is a symbolic link"):
        train(config(out, "train.resume=true", "train.steps=3"))
    (out / "metrics.jsonl").unlink()
    train(config(out, "train.resume=true", "train.steps=4"))
    for name, victim in victims.items():
        assert victim.read_text() == "the user's file", name
    assert not (out / "config.json").is_symlink()


# -- mode-prepare ---------------------------------------------------------------------------
def text_file(tmp_path: Path, text: str = "hello world, a few words to tokenize. " * 40) -> str:
    f = tmp_path / "in.txt"
    f.write_text(text)
    return str(f)


def test_prepare_again_removes_only_its_own_files(tmp_path):
    out = tmp_path / "data"
    src = text_file(tmp_path)
    prepare([src], out, shard_tokens=300)
    first = sorted(p.name for p in out.iterdir())
    assert "train_000001.bin" in first
    prepare([src], out, shard_tokens=10_000)  # fewer shards: the old second shard must go
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train_000000.bin", "val_000000.bin"]
    assert len(load_corpus(str(out), 8).train.tokens) > 0


@pytest.mark.parametrize("name", ["notes.txt", "train_notes.txt", "val_old.bin"])
def test_prepare_refuses_a_directory_with_other_files(tmp_path, name):
    out = tmp_path / "data"
    src = text_file(tmp_path)
    prepare([src], out)
    (out / name).write_text("mine")
    with pytest.raises(FileExistsError, match=f"{name}.*keep_other_files"):
        prepare([src], out)
    assert (out / name).read_text() == "mine"
    prepare([src], out, keep_other_files=True)
    assert (out / name).read_text() == "mine"


def test_the_prepare_cli_names_the_refusal(tmp_path):
    out = tmp_path / "data"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    done = subprocess.run(
        [sys.executable, "-m", "mode.prepare", text_file(tmp_path), "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "mode-prepare:" in done.stderr and "--keep-other-files" in done.stderr
    assert "Traceback" not in done.stderr


def test_shards_listed_outside_the_directory_are_refused(tmp_path):
    out = tmp_path / "data"
    prepare([text_file(tmp_path)], out)
    meta = json.loads((out / "meta.json").read_text())
    meta["shards"]["train"] = ["../../etc/passwd"]
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not a file name inside"):
        load_corpus(str(out), 8)
