"""``mode-prepare`` in bounded memory: the text is encoded piece by piece into a spill file and
the shards are copied from it. The reference is the tokenizer's encoding of each whole file
(what ``prepare`` wrote before it streamed), on the embedded corpus, non-ASCII text and CRLF
line ends; memory is measured with ``tracemalloc`` at two corpus sizes."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from mode.data import load_corpus, prepare_shakespeare, text_bytes_per_token
from mode.prepare import SPILL_NAME, prepare, text_pieces
from mode.tokenizer import load_tokenizer

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """Three documents: 80 kB of the embedded corpus, the same with CRLF line ends and
    non-ASCII lines, and a short last file."""
    root = tmp_path_factory.mktemp("texts")
    corpus = prepare_shakespeare("data").read_bytes()[:80_000].decode("utf-8", errors="ignore")
    mixed = "\r\n".join(f"{line} — ελληνικά, 日本語 {i}" for i, line in enumerate(corpus[:30_000].split("\n")))
    paths = [root / "a.txt", root / "b.txt", root / "c.txt"]
    paths[0].write_text(corpus, encoding="utf-8")
    paths[1].write_bytes(mixed.encode("utf-8"))
    paths[2].write_text("the end.\n", encoding="utf-8")
    return paths


@pytest.fixture(scope="module")
def bpe_dir(texts, tmp_path_factory):
    """A BPE of 500 ids trained on the texts."""
    out = tmp_path_factory.mktemp("bpe")
    prepare([str(p) for p in texts], out, bpe_vocab=500)
    return out


def whole_file_ids(paths, tok) -> np.ndarray:
    """The reference: each file's text encoded whole, joined by the end-of-text id."""
    ids: list[int] = []
    for i, p in enumerate(paths):
        if i and tok.eos_id is not None:
            ids.append(tok.eos_id)
        ids.extend(tok.encode(p.read_text(encoding="utf-8")))
    return np.asarray(ids)


def shard_ids(out) -> np.ndarray:
    corpus = load_corpus(str(out), 8)
    return np.concatenate([np.asarray(corpus.train.tokens), np.asarray(corpus.val.tokens)])


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_pieces_encode_as_the_whole_file(texts, bpe_dir, tmp_path, tokenizer):
    spec = "bytes" if tokenizer == "bytes" else str(bpe_dir / "tokenizer.json")
    tok = load_tokenizer(spec)
    pieces = list(text_pieces(texts[1], tok, chunk_chars=2_000))
    assert len(pieces) > 10 and "".join(pieces) == texts[1].read_text(encoding="utf-8")
    meta = prepare([str(p) for p in texts], tmp_path / "out", tokenizer=spec, chunk_chars=2_000, shard_tokens=7_000)
    want = whole_file_ids(texts, tok)
    np.testing.assert_array_equal(shard_ids(tmp_path / "out"), want)
    assert len(meta["shards"]["train"]) > 1
    assert meta["bytes_per_token"] == pytest.approx(text_bytes_per_token(tok, want[-meta["val_tokens"] :]), rel=1e-12)
    assert not (tmp_path / "out" / SPILL_NAME).exists()


def test_a_tokenizer_that_marks_every_input_gets_no_cut(texts, tmp_path):
    """A SentencePiece-style tokenizer prepends "▁" to every input: no cut encodes apart as it
    does together, so each file is one piece and the ids are still the whole file's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    raw.train([str(texts[0])], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.encode("ab\n") + tok.encode("cd") != tok.encode("ab\ncd")  # a naive cut would be wrong
    assert len(list(text_pieces(texts[0], tok, chunk_chars=2_000))) == 1
    prepare([str(texts[0]), str(texts[2])], tmp_path / "out", tokenizer=str(tmp_path), chunk_chars=2_000)
    np.testing.assert_array_equal(shard_ids(tmp_path / "out"), whole_file_ids([texts[0], texts[2]], tok))


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_peak_memory_is_flat_in_the_corpus_size(texts, bpe_dir, tmp_path, tokenizer):
    """Four times the text in one file, the same peak (Python and numpy allocations,
    ``tracemalloc``). The control: with pieces as large as the file (how prepare held a
    corpus before) the same measurement sees the peak grow."""
    spec = "bytes" if tokenizer == "bytes" else str(bpe_dir / "tokenizer.json")
    (tmp_path / "four.txt").write_text(texts[0].read_text(encoding="utf-8") * 4, encoding="utf-8")
    files = {"1x": str(texts[0]), "4x": str(tmp_path / "four.txt")}

    def peak(name: str, chunk_chars: int) -> int:
        return _peak_bytes(
            lambda: prepare([files[name]], tmp_path / f"{name}-{chunk_chars}", spec, chunk_chars=chunk_chars)
        )

    streamed = {name: peak(name, 8_000) for name in files}
    whole = {name: peak(name, 1 << 21) for name in files}  # 2 Mi characters: every file in one piece
    assert streamed["4x"] < 1.25 * streamed["1x"], streamed
    assert whole["4x"] > 1.4 * whole["1x"], whole
    assert streamed["4x"] < whole["1x"] / 4, (streamed, whole)


def test_a_killed_prepares_spill_file_is_removed_not_refused(texts, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / SPILL_NAME).write_bytes(b"\0" * 100)  # what a SIGKILL during encoding leaves
    prepare([str(texts[2]), str(texts[2])], out)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train_000000.bin", "val_000000.bin"]
