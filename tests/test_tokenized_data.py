"""Tokenizers and token data: ``mode-prepare`` (a BPE trained offline, shards, ``meta.json``),
training on it with bits per byte and samples decoded by its tokenizer, and the token file
formats (nanoGPT ``.bin``, ``.u32``, llm.c shards, globs)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mode.checkpoint import checkpoint_config
from mode.data import LLMC_MAGIC, load_corpus
from mode.prepare import prepare
from mode.tokenizer import ByteTokenizer, load_tokenizer
from mode.train import TrainResult, main
from tests.tiny import TINY

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """The first 60 kB of the embedded corpus, as a text file."""
    from mode.data import prepare_shakespeare

    path = tmp_path_factory.mktemp("text") / "shakespeare.txt"
    path.write_bytes(prepare_shakespeare("data").read_bytes()[:60_000])
    return path


def test_bits_per_byte_by_hand(tmp_path):
    """'abc' 1000 times, a BPE with two merges ('ab', 'abc'): 1000 ids of 3 bytes each."""
    text = tmp_path / "abc.txt"
    text.write_text("abc" * 1000)
    meta = prepare([str(text)], tmp_path / "tok", bpe_vocab=259, val_fraction=0.1)
    assert (meta["train_tokens"], meta["val_tokens"]) == (900, 100)
    assert meta["bytes_per_token"] == 3.0
    result = TrainResult(steps=1, train_loss=0.0, val_loss=3 * math.log(2), bytes_per_token=meta["bytes_per_token"])
    assert result.val_loss_text() == "val loss 2.0794 (1.000 bits/byte)"  # 3 bits per token over 3 bytes
    unknown = TrainResult(steps=1, train_loss=0.0, val_loss=3 * math.log(2), bytes_per_token=None)
    assert unknown.val_loss_text().endswith("(3.000 bits/token)")


def test_prepare_writes_shards_a_tokenizer_and_meta(text_file, tmp_path):
    meta = prepare([str(text_file)], tmp_path, bpe_vocab=400, shard_tokens=5000)
    assert meta["vocab_size"] == 400 and meta["tokenizer"] == "tokenizer.json" and meta["dtype"] == "uint16"
    shards = sorted(p.name for p in tmp_path.glob("train_*.bin"))
    assert len(shards) == math.ceil(meta["train_tokens"] / 5000) > 1
    tok = load_tokenizer(tmp_path)
    corpus = load_corpus(str(tmp_path), 32)
    assert (corpus.vocab_size, corpus.bytes_per_token) == (400, meta["bytes_per_token"])
    assert len(corpus.train) == meta["train_tokens"] and len(corpus.val) == meta["val_tokens"]
    # the shards are the text: decoding every id gives the file back
    ids = np.concatenate([np.asarray(corpus.train.tokens), np.asarray(corpus.val.tokens)])
    assert tok.decode(ids.tolist()) == text_file.read_text()
    assert 1.5 < meta["bytes_per_token"] < 4  # a BPE of 400 ids on English text


@pytest.mark.slow
def test_train_on_prepared_bpe_data_reports_bits_per_byte_and_samples_text(text_file, tmp_path, capsys):
    prepare([str(text_file)], tmp_path / "tok", bpe_vocab=400)
    run = [*TINY, f"data.source={tmp_path / 'tok'}", f"train.out_dir={tmp_path / 'run'}", "train.steps=3"]
    main(["--config", "mod", "--sample", "12", *run])
    out = capsys.readouterr().out
    assert "bits/byte" in out
    assert checkpoint_config(tmp_path / "run" / "ckpt.pt").model.vocab_size == 400  # read from meta.json
    # decoded by the BPE: as bytes, ids past 255 raised ("bytes must be in range(0, 256)"); a
    # byte-level BPE may still decode a barely trained model's ids to invalid UTF-8 (shown as U+FFFD)
    assert out.strip().splitlines()[-1]
    # the CLIs read the run's data and tokenizer from its checkpoint
    from mode.eval import main_eval, main_generate

    results = main_eval([str(tmp_path / "run" / "ckpt.pt"), "--max-batches", "2"])
    assert results["tokenizer"].endswith("tokenizer.json") and results["topk"]["bits_per_byte"] > 0
    text = main_generate([str(tmp_path / "run" / "ckpt.pt"), "--prompt", "KING", "--max-new-tokens", "5"])
    assert text.startswith("KING")


def test_a_text_file_with_a_tokenizer_trains_on_its_ids(text_file, tmp_path):
    prepare([str(text_file)], tmp_path / "tok", bpe_vocab=300)
    corpus = load_corpus(str(text_file), 32, tokenizer=str(tmp_path / "tok" / "tokenizer.json"))
    assert corpus.vocab_size == 300 and corpus.bytes_per_token > 1.2


def test_a_prepared_directory_refuses_another_tokenizer(text_file, tmp_path):
    prepare([str(text_file)], tmp_path / "tok", bpe_vocab=300)
    prepare([str(text_file)], tmp_path / "other", bpe_vocab=280)
    with pytest.raises(ValueError, match="data.tokenizer="):
        load_corpus(str(tmp_path / "tok"), 32, tokenizer=str(tmp_path / "other"))


def test_bytes_prepare_keeps_bytes(text_file, tmp_path):
    meta = prepare([str(text_file)], tmp_path, "bytes")
    assert (meta["vocab_size"], meta["tokenizer"], meta["bytes_per_token"]) == (256, "bytes", 1.0)
    assert isinstance(load_tokenizer(meta["tokenizer"]), ByteTokenizer)


def llmc_shard(path, ids: np.ndarray, version: int = 1, count: int | None = None) -> None:
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (LLMC_MAGIC, version, len(ids) if count is None else count)
    path.write_bytes(header.tobytes() + ids.tobytes())


def test_token_files_nanogpt_llmc_and_globs_read_the_same_ids(tmp_path):
    ids = (np.arange(3000) % 500).astype(np.uint16)
    ids.tofile(tmp_path / "nanogpt.bin")
    llmc_shard(tmp_path / "llmc.bin", ids)
    llmc_shard(tmp_path / "llmc32.bin", ids.astype(np.uint32), version=2)
    for k in range(3):
        ids[k * 1000 : (k + 1) * 1000].tofile(tmp_path / f"shard_{k}.bin")
    for source in ("nanogpt.bin", "llmc.bin", "llmc32.bin", "shard_*.bin"):
        corpus = load_corpus(str(tmp_path / source), 32, val_fraction=0.1)
        got = np.concatenate([np.asarray(corpus.train.tokens), np.asarray(corpus.val.tokens)])
        assert np.array_equal(got, ids), source
        assert corpus.vocab_size == 500 and corpus.bytes_per_token is None, source
    # a window across two shards reads both
    x, _ = load_corpus(str(tmp_path / "shard_*.bin"), 32, val_fraction=0.1).train.windows(torch_tensor([990]))
    assert x[0].tolist() == ids[990:1022].tolist()


def torch_tensor(values):
    import torch

    return torch.tensor(values)


@pytest.mark.parametrize("version,count,message", [(3, None, "version 3"), (1, 10_000, "promises 10000 tokens")])
def test_bad_llmc_headers_are_named(tmp_path, version, count, message):
    llmc_shard(tmp_path / "bad.bin", np.arange(600, dtype=np.uint16), version, count)
    with pytest.raises(ValueError, match=message):
        load_corpus(str(tmp_path / "bad.bin"), 32)


def test_prepare_cli_prints_the_split(text_file, tmp_path, capsys):
    from mode.prepare import main as prepare_main

    prepare_main([str(text_file), "--out", str(tmp_path), "--bpe", "300"])
    assert "vocabulary 300" in capsys.readouterr().out
    assert json.loads((tmp_path / "meta.json").read_text())["vocab_size"] == 300


NON_ASCII = "Größe, naïve café; Ærø — 日本語のテキスト, ελληνικά. " * 30


@pytest.mark.parametrize("bpe", [0, 400], ids=["bytes", "bpe"])
def test_bytes_per_token_counts_utf8_bytes_of_non_ascii_text(tmp_path, bpe):
    """Bits per byte divide by UTF-8 bytes, not characters: on text where they differ, the
    bytes per token of the validation split equal its UTF-8 length over its id count."""
    from mode.data import text_bytes_per_token
    from mode.tokenizer import load_tokenizer

    src = tmp_path / "in.txt"
    src.write_text(NON_ASCII, encoding="utf-8")
    out = tmp_path / "data"
    meta = prepare([str(src)], out, bpe_vocab=bpe, val_fraction=0.5)
    tok = load_tokenizer(str(out / "tokenizer.json") if bpe else "bytes")
    ids = tok.encode("日本語のテキスト, ελληνικά")
    assert text_bytes_per_token(tok, ids) == pytest.approx(len("日本語のテキスト, ελληνικά".encode()) / len(ids))
    # meta.json: the validation split is the last half of the ids; its text is (up to the
    # characters cut at the split) the last half of the file, whose UTF-8 bytes are counted.
    val_ids = meta["val_tokens"]
    val_bytes = len(tok.decode(tok.encode(NON_ASCII)[-val_ids:]).encode("utf-8"))
    assert meta["bytes_per_token"] == pytest.approx(val_bytes / val_ids, rel=0.01)
    if not bpe:  # every id is one byte (a character cut at the split decodes to U+FFFD: 3 bytes)
        assert meta["bytes_per_token"] == pytest.approx(1.0, abs=0.01)


def bpe_directory(tmp_path, text_file, special: list[str], declared: str | None):
    """A Hugging Face style tokenizer directory: a byte-level BPE of 300 ids with ``special``
    tokens, and a ``tokenizer_config.json`` declaring ``declared`` as its end of text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train([str(text_file)], trainers.BpeTrainer(vocab_size=300, special_tokens=special, initial_alphabet=alphabet))
    out = tmp_path / "published"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    if declared is not None:
        config = {"eos_token": {"content": declared, "special": True}, "bos_token": "<|begin_of_text|>"}
        (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_a_declared_end_of_text_token_is_used_by_prepare_and_kept(text_file, tmp_path, capsys):
    """Llama-3 naming: ``<|eot_id|>`` declared in tokenizer_config.json, beside
    ``<|begin_of_text|>``, is the end of text (it was found by name only, so: none)."""
    from mode.prepare import main as prepare_main

    published = bpe_directory(tmp_path, text_file, ["<|begin_of_text|>", "<|eot_id|>"], "<|eot_id|>")
    tok = load_tokenizer(published)
    eot = tok.tokenizer.token_to_id("<|eot_id|>")
    assert tok.eos_id == eot and "declared in tokenizer_config.json" in tok.eos_how
    second = tmp_path / "second.txt"
    second.write_text("A second document.")
    prepare_main([str(text_file), str(second), "--out", str(tmp_path / "prep"), "--tokenizer", str(published)])
    said = capsys.readouterr().out
    assert "end of text: '<|eot_id|>', declared in tokenizer_config.json (documents joined by it)" in said
    corpus = load_corpus(str(tmp_path / "prep"), 32)
    ids = np.concatenate([np.asarray(corpus.train.tokens), np.asarray(corpus.val.tokens)])
    assert (ids == eot).sum() == 1  # one separator between the two documents
    assert load_tokenizer(tmp_path / "prep").eos_id == eot  # the prepared directory declares it too


def test_a_tokenizer_without_an_end_of_text_token_says_so(text_file, tmp_path, capsys):
    from mode.prepare import main as prepare_main

    published = bpe_directory(tmp_path, text_file, ["<|begin_of_text|>"], None)
    assert load_tokenizer(published).eos_id is None
    prepare_main([str(text_file), "--out", str(tmp_path / "prep"), "--tokenizer", str(published)])
    assert "end of text: none: the tokenizer declares no end-of-text token (documents joined with no separator)" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize("text", ["[1, 2]", "{not json"])
def test_a_damaged_tokenizer_config_is_named(text_file, tmp_path, text):
    published = bpe_directory(tmp_path, text_file, ["<|eot_id|>"], "<|eot_id|>")
    (published / "tokenizer_config.json").write_text(text)
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        load_tokenizer(published)


def test_data_encode_and_decode_are_the_byte_tokenizer():
    """``mode.data.encode`` / ``decode`` (the demo's) are ``ByteTokenizer``'s, on non-ASCII text
    and on ids that are not valid UTF-8."""
    import torch

    from mode.data import decode, encode

    text = "Ünïcode ✓ and ASCII"
    assert encode(text).tolist() == [list(text.encode("utf-8"))]
    assert decode(encode(text)) == text
    assert decode(torch.tensor([[0xFF, 104, 105]])) == "\ufffdhi"
