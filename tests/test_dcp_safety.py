"""A sharded (DCP) checkpoint directory never runs code on load: its ``.metadata`` replaced by a
stealth payload (it runs a command, then yields the real metadata so that the load would
succeed), with ``checksums.json`` recomputed as an attacker would, goes through every path that
loads a checkpoint; nothing runs and a ``CheckpointError`` names the file and ``trust_file=True``.
The same payload with ``trust_file=True`` does run, so the test can fail."""

import pickle
from pathlib import Path

import pytest
import torch

from mode import checkpoint
from mode.checkpoint import FORMAT_VERSION, CheckpointError
from mode.config import load_config, to_dict
from mode.convert import upcycle
from mode.eval import main_eval, main_generate
from mode.hf import main as export_main
from mode.model import MoDETransformer
from mode.parallel.mesh import ONE_PROCESS
from tests.tiny import TINY


class Stealth:
    """Unpickles by running ``code`` (touching ``marker``), then returns the real metadata."""

    def __init__(self, real: bytes, marker: Path) -> None:
        self.real, self.marker = real, marker

    def __reduce__(self):
        code = f"(open({str(self.marker)!r}, 'w').close(), __import__('pickle').loads({self.real!r}))[1]"
        return eval, (code,)


def sharded_checkpoint(directory: Path, preset: str = "dense") -> MoDETransformer:
    """A DCP checkpoint directory as ``mode-train`` under torchrun writes one (model, AdamW,
    progress, config), written by this one process."""
    cfg = load_config(preset, TINY)
    torch.manual_seed(0)
    model = MoDETransformer(cfg.model)
    opt = torch.optim.AdamW(model.parameters())
    extra = {
        "format_version": FORMAT_VERSION,
        "step": 3,
        "elapsed": 1.0,
        "rng": torch.get_rng_state(),
        "data_rng": None,
        "config": to_dict(cfg),
    }
    checkpoint.save_sharded(directory, model, ONE_PROCESS, extra, opt)
    return model


def plant_payload(directory: Path, marker: Path) -> None:
    meta = directory / ".metadata"
    meta.write_bytes(pickle.dumps(Stealth(meta.read_bytes(), marker)))
    (directory / "checksums.json").unlink()
    checkpoint._write_checksums(directory)  # an attacker recomputes the CRCs: they are no signature


@pytest.fixture
def planted(tmp_path):
    directory = tmp_path / "ckpt"
    model = sharded_checkpoint(directory)
    marker = tmp_path / "ran"
    plant_payload(directory, marker)
    return directory, marker, model


def fresh(directory: Path) -> MoDETransformer:
    return MoDETransformer(checkpoint.checkpoint_config(directory).model)


PATHS = {
    "load": lambda d, out: checkpoint.load(d, fresh(d)),
    "load_checkpoint": lambda d, out: checkpoint.load_checkpoint(d, fresh(d)),
    "from_checkpoint": lambda d, out: MoDETransformer.from_checkpoint(d),
    "upcycle": lambda d, out: upcycle(d, load_config("mode_staged", TINY)),
    "resume (load_newest_good)": lambda d, out: checkpoint.load_newest_good(d, fresh(d), warn=lambda _: None),
    "mode-eval": lambda d, out: main_eval([str(d), "--max-batches", "1"]),
    "mode-generate": lambda d, out: main_generate([str(d), "--max-new-tokens", "2"]),
    "mode-export": lambda d, out: export_main([str(d), str(out / "export")]),
}


@pytest.mark.parametrize("path", list(PATHS), ids=list(PATHS))
def test_a_planted_metadata_payload_runs_nothing(planted, tmp_path, path):
    directory, marker, _ = planted
    with pytest.raises(CheckpointError, match="trust_file=True") as info:
        PATHS[path](directory, tmp_path)
    assert ".metadata" in str(info.value) and str(directory) in str(info.value)
    assert not marker.exists()


def test_init_from_a_planted_directory_runs_nothing(planted, tmp_path):
    from mode.train import main

    directory, marker, _ = planted
    with pytest.raises(CheckpointError, match="trust_file=True"):
        main(["--config", "mode_staged", "--init-from", str(directory), *TINY, f"train.out_dir={tmp_path / 'run'}"])
    assert not marker.exists()


def test_the_payload_is_real_trust_file_runs_it(planted):
    directory, marker, model = planted
    restored = fresh(directory)
    assert checkpoint.load(directory, restored, trust_file=True).step == 3
    assert marker.exists()  # what the refusal prevents
    for name, value in model.state_dict().items():
        assert torch.equal(restored.state_dict()[name], value), name


def test_our_own_directories_load_and_equal_what_was_saved(tmp_path):
    directory = tmp_path / "ckpt"
    model = sharded_checkpoint(directory, "mode_staged")
    restored = fresh(directory)
    assert checkpoint.load(directory, restored).step == 3
    for name, value in model.state_dict().items():
        assert torch.equal(restored.state_dict()[name], value), name


def metadata_with(directory: Path, change) -> None:
    meta = directory / ".metadata"
    md = pickle.loads(meta.read_bytes())
    change(md)
    meta.write_bytes(pickle.dumps(md))
    (directory / "checksums.json").unlink()
    checkpoint._write_checksums(directory)


def test_storage_files_outside_the_directory_are_refused(tmp_path):
    directory = tmp_path / "ckpt"
    sharded_checkpoint(directory)
    outside = tmp_path / "elsewhere.distcp"
    outside.write_bytes((directory / "__0_0.distcp").read_bytes())

    def point_outside(md):
        for info in md.storage_data.values():
            info.relative_path = "../elsewhere.distcp"

    metadata_with(directory, point_outside)
    with pytest.raises(CheckpointError, match="not a file name"):
        checkpoint.load(directory, fresh(directory))


class RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return eval, (f"open({str(self.marker)!r}, 'w').close()",)


@pytest.mark.parametrize("trust", [False, True], ids=["default", "trust_file"])
def test_bytes_entries_are_read_without_running_code(tmp_path, trust):
    """A metadata that declares a weight a bytes entry, pointing at a pickled payload in a file
    of the directory: torch's own planner unpickles it with ``weights_only=False`` (it runs
    under ``trust_file=True``); ours refuses it."""
    import io

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    directory = tmp_path / "ckpt"
    sharded_checkpoint(directory)
    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save(RunsACommand(marker), buffer)
    (directory / "__9_0.distcp").write_bytes(buffer.getvalue())
    name = "model.tok_emb.weight"

    def declare_bytes(md):
        md.state_dict_metadata[name] = BytesStorageMetadata()
        md.storage_data[MetadataIndex(name)] = _StorageInfo("__9_0.distcp", 0, len(buffer.getvalue()))

    metadata_with(directory, declare_bytes)
    if trust:
        try:
            checkpoint.load(directory, fresh(directory), trust_file=True)
        except Exception:  # noqa: BLE001, S110  (a bytes value where a tensor belongs: what matters ran before)
            pass
        assert marker.exists()
        return
    with pytest.raises(CheckpointError, match=str(directory)):
        checkpoint.load(directory, fresh(directory))
    assert not marker.exists()


def test_a_directory_without_checksums_is_named(tmp_path):
    directory = tmp_path / "ckpt"
    model = sharded_checkpoint(directory)
    (directory / "checksums.json").unlink()
    with pytest.raises(CheckpointError, match="no checksums.json.*trust_file=True"):
        checkpoint.load(directory, fresh(directory))
    restored = fresh(directory)
    checkpoint.load(directory, restored, trust_file=True)
    assert torch.equal(restored.tok_emb.weight, model.tok_emb.weight)
