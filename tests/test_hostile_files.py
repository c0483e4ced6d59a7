"""Files that lie about their sizes, types and paths: each is refused by name, before memory is
spent on what it declares, and none picks a path of its own or reads the environment.

The memory cases run the load in a child process and measure its peak resident set over the
baseline after imports (``resource.getrusage``): each stays under ``BOUND`` while the file
declares far more (the code before these checks allocated 0.5-1.6 GB on them)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mode import checkpoint
from mode.checkpoint import CheckpointError
from mode.checks import ConfigError
from mode.config import load_config
from mode.data import load_corpus
from mode.model import MoDETransformer
from mode.prepare import prepare
from tests.tiny import TINY

BOUND = 200 * 2**20  # bytes over the process baseline
ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, resource, sys
from mode.model import MoDETransformer
from mode.hf import from_hf
from mode import checkpoint
def peak(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base = peak()
kind, path = sys.argv[1], sys.argv[2]
try:
    if kind == "checkpoint":
        MoDETransformer.from_checkpoint(path)
    elif kind == "read":
        checkpoint.read_file(path)
    else:
        from_hf(path)
    error = None
except Exception as e:
    error = f"{type(e).__name__}: {e}"
print(json.dumps({"over_baseline": peak() - base, "error": error}))
"""


def load_in_child(kind: str, path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, kind, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def saved_state(tmp_path: Path) -> tuple[Path, dict]:
    """A real ``ckpt.pt`` written by ``checkpoint.save`` and its state as a dict (digest removed)."""
    cfg = load_config("dense", TINY)
    torch.manual_seed(0)
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, MoDETransformer(cfg.model), progress=checkpoint.Progress(1), cfg=cfg)
    state = torch.load(path, weights_only=True)
    state.pop("digest")
    return path, state


def rewrite(path: Path, state: dict) -> None:
    """Save ``state`` with a digest recomputed, as an attacker would (a CRC is no signature)."""
    torch.save({**state, "digest": checkpoint._digest(state)}, path)


def test_a_stride_zero_tensor_is_refused_before_it_is_read_whole(tmp_path):
    path, state = saved_state(tmp_path)
    state["junk"] = torch.zeros(1).expand(20000, 20000)  # 1.6 GB declared, 4 bytes stored
    torch.save({**state, "digest": 0}, path)
    assert path.stat().st_size < 2**20
    got = load_in_child("read", path)
    assert got["error"].startswith("CheckpointError") and "junk" in got["error"] and "stride-0" in got["error"]
    assert got["over_baseline"] < BOUND, got


def test_a_config_larger_than_its_weights_is_refused_before_the_model_is_built(tmp_path):
    path, state = saved_state(tmp_path)
    state["config"]["model"]["vocab_size"] = 4_000_000  # a 512 MB embedding, weights of 256 rows
    rewrite(path, state)
    got = load_in_child("checkpoint", path)
    assert got["error"].startswith("CheckpointError"), got
    assert "tok_emb.weight is [4000000, 32] in the model, [256, 32] in the file" in got["error"]
    assert "config differs from the checkpoint" in got["error"]
    assert got["over_baseline"] < BOUND, got


def test_a_sharded_checkpoint_whose_config_lies_is_refused_from_its_headers(tmp_path):
    from tests.test_dcp_safety import sharded_checkpoint

    directory = tmp_path / "ckpt"
    sharded_checkpoint(directory)
    extra = torch.load(directory / "extra.pt", weights_only=True)
    extra["config"]["model"]["vocab_size"] = 4_000_000
    torch.save(extra, directory / "extra.pt")
    (directory / "checksums.json").unlink()
    checkpoint._write_checksums(directory)
    got = load_in_child("checkpoint", directory)
    assert got["error"].startswith("CheckpointError") and "tok_emb.weight is [4000000, 32]" in got["error"], got
    assert got["over_baseline"] < BOUND, got


def test_integer_weights_are_refused_not_cast(tmp_path):
    path, state = saved_state(tmp_path)
    state["model"]["tok_emb.weight"] = torch.zeros(256, 32, dtype=torch.int64)
    rewrite(path, state)
    with pytest.raises(CheckpointError, match=r"tok_emb.weight is stored as torch.int64, not a floating dtype"):
        MoDETransformer.from_checkpoint(path)
    model = MoDETransformer(load_config("dense", TINY).model)
    with pytest.raises(CheckpointError, match="torch.int64"):
        checkpoint.load(path, model)


def test_a_model_of_another_config_is_named_as_such(tmp_path):
    path, _ = saved_state(tmp_path)
    other = MoDETransformer(load_config("dense", [*TINY, "model.d_model=48"]).model)
    with pytest.raises(CheckpointError, match=r"\[48\] in the model, \[32\] in the file.*config differs"):
        checkpoint.load(path, other)


def hf_dir(tmp_path: Path) -> Path:
    from tests.test_hf import hf_model

    out = tmp_path / "hf"
    hf_model("llama").save_pretrained(out)
    return out


def test_a_hugging_face_config_larger_than_its_weights_is_refused_first(tmp_path):
    pytest.importorskip("transformers")
    out = hf_dir(tmp_path)
    config = json.loads((out / "config.json").read_text())
    config["vocab_size"] = 4_000_000
    (out / "config.json").write_text(json.dumps(config))
    got = load_in_child("hf", out)
    assert got["error"].startswith("UnsupportedCheckpoint") and "shape" in got["error"], got
    assert got["over_baseline"] < BOUND, got


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.complex64])
def test_hugging_face_weights_of_a_non_floating_dtype_are_refused(tmp_path, dtype):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from mode.hf import UnsupportedCheckpoint, from_hf

    out = hf_dir(tmp_path)
    state = load_file(out / "model.safetensors")
    name = "model.embed_tokens.weight"
    state[name] = torch.zeros(state[name].shape, dtype=dtype)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedCheckpoint, match=f"tok_emb.weight is stored as {dtype}"):
        from_hf(out)


def test_a_damaged_safetensors_shard_is_named(tmp_path):
    pytest.importorskip("transformers")
    from mode.hf import UnsupportedCheckpoint, from_hf

    out = hf_dir(tmp_path)
    (out / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(UnsupportedCheckpoint, match="model.safetensors is not a readable safetensors file"):
        from_hf(out)


@pytest.fixture
def prepared(tmp_path) -> Path:
    text = tmp_path / "text.txt"
    text.write_text("a small corpus of plain words, repeated. " * 40)
    out = tmp_path / "prep"
    prepare([str(text)], out)
    return out


def edit_meta(directory: Path, **fields) -> None:
    meta = json.loads((directory / "meta.json").read_text())
    meta.update(fields)
    (directory / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("name", ["../elsewhere/tokenizer.json", "/etc/passwd", "sub/tokenizer.json", ""])
def test_meta_json_names_only_its_own_tokenizer(prepared, name):
    edit_meta(prepared, tokenizer=name)
    with pytest.raises(ValueError, match=r"meta.json: tokenizer=.* is not 'bytes' or a file name inside"):
        load_corpus(str(prepared), 16)


def test_meta_json_tokenizer_as_a_link_is_refused(prepared, tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    os.symlink(outside, prepared / "tokenizer.json")
    edit_meta(prepared, tokenizer="tokenizer.json")
    with pytest.raises(FileNotFoundError, match="not a plain file"):
        load_corpus(str(prepared), 16)


@pytest.mark.parametrize("vocab", [10**9, 0, -3, "256", True])
def test_meta_json_vocab_size_is_bounded_by_its_tokenizer(prepared, vocab):
    edit_meta(prepared, vocab_size=vocab)
    with pytest.raises(ValueError, match=r"meta.json: vocab_size=.* must be an int in \[1, 256\]"):
        load_corpus(str(prepared), 16)


@pytest.mark.parametrize("per_token", [0, -1.0, "x"])
def test_meta_json_bytes_per_token_must_be_positive(prepared, per_token):
    edit_meta(prepared, bytes_per_token=per_token)
    with pytest.raises(ValueError, match="bytes_per_token"):
        load_corpus(str(prepared), 16)


def test_meta_json_that_is_not_an_object_is_named(prepared):
    (prepared / "meta.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="meta.json holds a list, not an object"):
        load_corpus(str(prepared), 16)


def test_a_checkpoint_config_is_data_not_a_template(tmp_path, monkeypatch):
    monkeypatch.setenv("MODE_TEST_SECRET", "s3cr3t-value")
    path, state = saved_state(tmp_path)
    state["config"]["data"]["source"] = "${oc.env:MODE_TEST_SECRET}"
    rewrite(path, state)
    with pytest.raises(ConfigError, match=r"data.source holds an interpolation") as err:
        checkpoint.checkpoint_config(path)
    assert "s3cr3t-value" not in str(err.value)
    with pytest.raises(ConfigError):
        MoDETransformer.from_checkpoint(path)


def test_mode_eval_never_writes_where_the_checkpoint_says(tmp_path):
    """A checkpoint whose ``data.cache_dir`` points elsewhere: ``mode-eval`` fetches and writes
    only under ``--cache-dir`` (here a copy of the corpus already fetched)."""
    from mode.data import prepare_shakespeare
    from mode.eval import main_eval

    path, state = saved_state(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    state["config"]["data"].update(source="shakespeare", cache_dir=str(elsewhere))
    rewrite(path, state)
    mine = tmp_path / "mine" / "shakespeare"
    mine.mkdir(parents=True)
    (mine / "corpus.bin").write_bytes(Path(prepare_shakespeare("data")).read_bytes()[:100_000])
    main_eval([str(path), "--cache-dir", str(tmp_path / "mine"), "--max-batches", "1"])
    assert not elsewhere.exists()
