"""Loading a checkpoint never runs code from the file, and a bad file is named in the error:
a pickled payload (refused unless ``trust_file=True``), a file cut short, a newer format."""

import errno
import fractions
import os
import subprocess

import pytest
import torch

from mode import checkpoint
from mode.checkpoint import FORMAT_VERSION, CheckpointError, CheckpointWriteError
from mode.config import load_config
from mode.model import MoDETransformer
from mode.parallel.mesh import ONE_PROCESS
from tests.tiny import TINY_MODEL


class RunsACommand:
    """What an attacker pickles: unpickling it calls ``os.system``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return MoDETransformer(load_config("mod", TINY_MODEL).model)


def test_a_checkpoint_with_a_pickled_payload_is_refused_and_runs_nothing(tmp_path, model):
    marker = tmp_path / "pwned"
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": None, "step": 1, "x": RunsACommand(str(marker))}, path)
    for load in (
        lambda: checkpoint.load_checkpoint(path, model),
        lambda: checkpoint.checkpoint_config(path),
    ):
        with pytest.raises(CheckpointError, match="trust_file=True") as info:
            load()
        assert str(path) in str(info.value)
    assert not marker.exists()


def test_trust_file_loads_what_weights_only_refuses(tmp_path, model):
    path = tmp_path / "ckpt.pt"
    state = {"model": model.state_dict(), "optimizer": None, "step": 3, "note": fractions.Fraction(1, 3)}
    torch.save(state, path)
    with pytest.raises(CheckpointError):
        checkpoint.load_checkpoint(path, model)
    assert checkpoint.load_checkpoint(path, model, trust_file=True) == 3


def test_our_own_checkpoints_load_safely_and_carry_the_format_version(tmp_path, model):
    path = tmp_path / "ckpt.pt"
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))[1].backward()
    opt.step()
    checkpoint.save(path, model, opt, checkpoint.Progress(7, 1.5))
    assert checkpoint.read_file(path)["format_version"] == FORMAT_VERSION
    assert checkpoint.load(path, model, opt) == checkpoint.Progress(7, 1.5)


def test_a_checkpoint_cut_short_is_named(tmp_path, model):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, model, progress=checkpoint.Progress(2))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cut short or corrupted") as info:
        checkpoint.load_checkpoint(path, model)
    assert str(path) in str(info.value)


def test_a_newer_format_is_refused_naming_both_versions(tmp_path, model):
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "step": 0, "format_version": FORMAT_VERSION + 1}, path)
    with pytest.raises(CheckpointError, match=f"version {FORMAT_VERSION + 1}.*up to {FORMAT_VERSION}"):
        checkpoint.load_checkpoint(path, model)


def test_not_a_checkpoint(tmp_path, model):
    path = tmp_path / "ckpt.pt"
    path.write_text("hello")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        checkpoint.load_checkpoint(path, model)


def test_a_config_file_cannot_run_code(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text(f'model: !!python/object/apply:os.system ["touch {marker}"]\n')
    with pytest.raises(ValueError, match="not plain YAML") as info:
        load_config(path)
    assert str(path.resolve()) in str(info.value)
    assert not marker.exists()


def flip_a_byte(path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_bytes_in_a_checkpoint_are_caught(tmp_path, model):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, model, progress=checkpoint.Progress(2))
    flip_a_byte(path)  # inside the tensor data: torch.load alone reads it without complaint
    with pytest.raises(CheckpointError, match="checksum|cut short or corrupted") as info:
        checkpoint.load_checkpoint(path, model)
    assert str(path) in str(info.value)


def test_resume_falls_back_to_the_newest_good_checkpoint(tmp_path, model):
    path = tmp_path / "ckpt.pt"
    for step in (1, 2, 3):
        with torch.no_grad():
            model.tok_emb.weight.fill_(step)
        checkpoint.save(path, model, progress=checkpoint.Progress(step), keep=3)
    flip_a_byte(path)
    said = []
    found, progress = checkpoint.load_newest_good(path, model, warn=said.append)
    assert progress.step == 2 and found.name == "ckpt.pt.step2"
    assert torch.all(model.tok_emb.weight == 2)
    assert len(said) == 1 and "ckpt.pt skipped" in said[0]


def test_a_dcp_directory_with_a_damaged_shard_is_caught(tmp_path, model):
    import torch.distributed.checkpoint as dcp

    from mode.checkpoint import _dcp_state, _write_checksums, verify_directory

    directory = tmp_path / "ckpt"
    dcp.save(_dcp_state(model, None, ONE_PROCESS), checkpoint_id=str(directory))
    _write_checksums(directory)
    verify_directory(directory)  # as written: passes
    shard = next(f for f in sorted(directory.iterdir()) if f.suffix == ".distcp")
    flip_a_byte(shard)
    with pytest.raises(CheckpointError, match="fails its checksum") as info:
        checkpoint.load(directory, model)
    assert shard.name in str(info.value)


@pytest.fixture
def small_filesystem(tmp_path):
    """A real tmpfs of 96 KiB at tmp_path/small (needs the right to mount: root here)."""
    mount = tmp_path / "small"
    mount.mkdir()
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mount)], capture_output=True)
        why = proc.stderr.decode().strip() if proc.returncode else None
    except OSError as e:  # no mount command
        why = str(e)
    if why is not None:
        pytest.skip(f"cannot mount a small filesystem here ({why}): the stand-in test covers it")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_leaves_the_last_good_checkpoint(small_filesystem):
    torch.manual_seed(0)
    small = MoDETransformer(load_config("dense", ["model.d_model=32", "model.n_layers=1", "model.n_heads=2"]).model)
    path = small_filesystem / "ckpt.pt"
    checkpoint.save(path, small, progress=checkpoint.Progress(1))
    assert path.stat().st_size > 48 * 1024  # a second copy beside it cannot fit in 96 KiB
    with pytest.raises(CheckpointWriteError, match="is intact") as info:
        checkpoint.save(path, small, progress=checkpoint.Progress(2))
    assert "bytes free on its filesystem" in str(info.value)
    assert not (small_filesystem / "ckpt.pt.tmp").exists()
    assert checkpoint.load_checkpoint(path, small) == 1


def test_a_failed_write_leaves_the_last_good_checkpoint_stand_in(tmp_path, model, monkeypatch):
    """Stand-in for a full disk where no filesystem can be mounted: the write raises ENOSPC."""
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, model, progress=checkpoint.Progress(1))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(CheckpointWriteError, match="No space left on device.*is intact"):
        checkpoint.save(path, model, progress=checkpoint.Progress(2))
    monkeypatch.undo()
    assert not (tmp_path / "ckpt.pt.tmp").exists()
    assert checkpoint.load_checkpoint(path, model) == 1
