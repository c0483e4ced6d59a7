"""``mode-prepare``: text files -> token shards, a tokenizer and ``meta.json`` for ``data.source``.

    mode-prepare corpus/*.txt --out data/tok --bpe 4096          # train a byte-level BPE (offline)
    mode-prepare corpus/*.txt --out data/tok --tokenizer path/to/llama   # a given tokenizer
    mode-prepare shakespeare --out data/shakespeare_bpe --bpe 2048       # the embedded corpus

Each input file is a document; documents are joined by the end-of-text id when the tokenizer
has one. The last ``--val-fraction`` of the ids (at least one shard's worth of the end) is the
validation split. Shards hold at most ``--shard-tokens`` ids: ``uint16`` ``.bin`` files when the
vocabulary fits (nanoGPT's format), ``uint32`` ``.u32`` otherwise. ``meta.json`` records the
vocabulary, the tokenizer (``bytes`` or the ``tokenizer.json`` copied beside the shards), the
id dtype, the token counts and the validation split's UTF-8 bytes per token, from which
training reports bits per byte.

Memory is bounded by ``chunk_chars``, not by the corpus: each file is read and encoded in
pieces of about that many characters, the ids go to a spill file beside the shards
(``.ids.partial``, removed at the end; a leftover of a killed run is ours to remove), and the
shards are copied from it once the split is known. A piece ends only where the tokenizer
splits anyway, as far as a window can show it: after a line break between two non-space
characters, and only where encoding ``CUT_WINDOW`` characters each side of the cut gives the
same ids as encoding its two sides apart
(so a tokenizer that marks the start of every input, e.g. a prepended SentencePiece "▁",
gets no cut: such a file is encoded whole, as before). The shards are the ids of encoding
each file whole.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mode.data import prepare_shakespeare
from mode.tokenizer import CONFIG_NAME, ByteTokenizer, load_tokenizer, train_bpe

__all__ = ["main", "prepare", "text_pieces"]

CHUNK_CHARS = 1 << 18  # characters per encode call: a piece's Encoding costs ~100x its size in a BPE
SPILL_NAME = ".ids.partial"  # every id in order, before the split is known
CUT_WINDOW = 256  # characters each side of a cut that must encode apart as they do together
CUT_TRIES = 8  # line breaks tried per piece before reading on


def _input_files(inputs: list[str], cache_dir: str) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        if item == "shakespeare":
            files.append(prepare_shakespeare(cache_dir))
            continue
        matched = sorted(glob.glob(item)) if glob.has_magic(item) else [item]
        if not matched or not all(Path(f).is_file() for f in matched):
            raise FileNotFoundError(f"input {item!r}: no such text file")
        files.extend(Path(f) for f in matched)
    return files


def _splits_at(tok, text: str, cut: int) -> bool:
    """Whether ``tok`` encodes the text around ``cut`` as the ids of its two sides apart."""
    left, right = text[max(0, cut - CUT_WINDOW) : cut], text[cut : cut + CUT_WINDOW]
    return tok.encode(left + right) == tok.encode(left) + tok.encode(right)


def _cut(tok, buf: str) -> int | None:
    """The last place in ``buf`` (past its first half, ``CUT_WINDOW`` before its end) where a
    piece may end (see the module docstring), or None."""
    if isinstance(tok, ByteTokenizer):
        return len(buf)  # UTF-8 bytes of a concatenation are the concatenation of the bytes
    end = len(buf) - CUT_WINDOW
    for _ in range(CUT_TRIES):
        i = buf.rfind("\n", len(buf) // 2, end)
        if i < 1:
            return None
        if not buf[i - 1].isspace() and not buf[i + 1].isspace() and _splits_at(tok, buf, i + 1):
            return i + 1
        end = i
    return None


def text_pieces(path: str | Path, tok, chunk_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """The text of ``path`` (UTF-8, universal newlines, as ``Path.read_text``) in pieces of about
    ``chunk_chars`` characters whose encodings, joined, are the encoding of the whole text."""
    buf = ""
    with open(path, encoding="utf-8") as fh:
        while more := fh.read(chunk_chars):
            buf += more
            cut = _cut(tok, buf)
            if cut is not None:
                yield buf[:cut]
                buf = buf[cut:]
    if buf:
        yield buf


def _encode_into(spill: Path, files: list[Path], tok, dtype, chunk_chars: int) -> list[tuple[int, int]]:
    """Write the ids of ``files`` (joined by the end-of-text id) to ``spill``; returns the
    [start, end) id range of each encoded piece (the end-of-text ids lie between them)."""
    pieces, total = [], 0
    with open(spill, "wb") as fh:
        for i, f in enumerate(files):
            if i and tok.eos_id is not None:
                np.asarray([tok.eos_id], dtype=dtype).tofile(fh)
                total += 1
            for piece in text_pieces(f, tok, chunk_chars):
                ids = np.asarray(tok.encode(piece), dtype=dtype)
                ids.tofile(fh)
                pieces.append((total, total + len(ids)))
                total += len(ids)
    return pieces


def _read(spill: Path, dtype, start: int, stop: int) -> np.ndarray:
    """ids[start:stop] of the spill file (read, not mapped: the pages do not stay resident)."""
    return np.fromfile(spill, dtype=dtype, count=stop - start, offset=start * np.dtype(dtype).itemsize)


def _bytes_per_token(tok, spill: Path, dtype, pieces: list[tuple[int, int]], start: int, total: int) -> float:
    """UTF-8 bytes of the text ``ids[start:total]`` decodes to (special tokens left out) per id,
    decoded piece by piece (a piece is whole characters)."""
    n_bytes = 0
    for a, b in pieces:
        if b > start:
            n_bytes += len(tok.decode_text(_read(spill, dtype, max(a, start), b).tolist()).encode("utf-8"))
    return n_bytes / max(1, total - start)


def _write_shards(
    out: Path, spill: Path, dtype, name: str, lo: int, hi: int, shard_tokens: int, suffix: str, copy_ids: int
) -> list[str]:
    """Copy ids[lo:hi] of the spill file, ``copy_ids`` at a time, into shards
    ``{name}_{k:06d}{suffix}`` of ``shard_tokens`` ids."""
    names = []
    for k, start in enumerate(range(lo, hi, shard_tokens)):
        names.append(f"{name}_{k:06d}{suffix}")
        with open(out / names[-1], "wb") as fh:
            stop = min(start + shard_tokens, hi)
            for a in range(start, stop, copy_ids):
                _read(spill, dtype, a, min(a + copy_ids, stop)).tofile(fh)
    return names


def prepare(
    inputs: list[str],
    out: str | Path,
    tokenizer: str = "bytes",
    bpe_vocab: int = 0,
    val_fraction: float = 0.05,
    shard_tokens: int = 100_000_000,
    cache_dir: str = "data",
    keep_other_files: bool = False,
    chunk_chars: int = CHUNK_CHARS,
) -> dict:
    """Tokenize ``inputs`` into ``out`` (see the module docstring); returns the meta dict.
    ``bpe_vocab > 0`` trains a BPE of that size instead of using ``tokenizer``;
    ``chunk_chars``: characters of text per encode call (what bounds the memory).

    A directory prepared before is prepared again in place: only the files its ``meta.json``
    lists (shards, tokenizer, ``meta.json``) are removed. A directory holding any other file is
    refused (``FileExistsError``) unless ``keep_other_files``, which leaves those files alone."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction}: must be in (0, 1)")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens}: must be >= 1")
    if chunk_chars < 1:
        raise ValueError(f"chunk_chars={chunk_chars}: must be >= 1")
    files = _input_files(inputs, cache_dir)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    leftover = out / SPILL_NAME  # a killed prepare's spill file: the name is ours
    if leftover.is_file() and not leftover.is_symlink():
        leftover.unlink()
    ours, others = _earlier_preparation(out)
    if others and not keep_other_files:
        names = ", ".join(p.name for p in others[:6]) + (", ..." if len(others) > 6 else "")
        raise FileExistsError(
            f"{out} holds files mode-prepare did not write ({names}): choose an empty directory, or pass "
            "keep_other_files=True (--keep-other-files) to write beside them (they are left as they are)"
        )
    for old in ours:
        old.unlink()  # a second run into the same directory leaves no shard of the first
    tok = train_bpe(files, bpe_vocab) if bpe_vocab else load_tokenizer(tokenizer)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    suffix = ".bin" if dtype == np.uint16 else ".u32"
    spill = out / SPILL_NAME
    try:
        pieces = _encode_into(spill, files, tok, dtype, chunk_chars)
        total = spill.stat().st_size // np.dtype(dtype).itemsize
        n_val = max(1, int(total * val_fraction))
        if total - n_val < 1:
            raise ValueError(f"the inputs encode to {total} ids: too few to split")
        shards = {
            "train": _write_shards(out, spill, dtype, "train", 0, total - n_val, shard_tokens, suffix, chunk_chars),
            "val": _write_shards(out, spill, dtype, "val", total - n_val, total, shard_tokens, suffix, chunk_chars),
        }
        counts = {"train_tokens": total - n_val, "val_tokens": n_val}
        bytes_per_token = _bytes_per_token(tok, spill, dtype, pieces, total - n_val, total)
    finally:
        spill.unlink(missing_ok=True)
    if isinstance(tok, ByteTokenizer):
        spec = "bytes"
    else:
        tok.save(out / "tokenizer.json")
        spec = "tokenizer.json"
    meta = {
        "vocab_size": tok.vocab_size,
        "tokenizer": spec,
        "eos_id": tok.eos_id,
        "eos": tok.eos_how,  # how the end-of-text token was found (documents are joined by it)
        "dtype": np.dtype(dtype).name,
        **counts,
        "bytes_per_token": bytes_per_token,
        "sources": [str(f) for f in files],
        "shards": shards,  # the files of each split, in order (what a later prepare removes)
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


SHARD_NAME = re.compile(r"(train|val)_\d{6}\.(bin|u32)")


def _earlier_preparation(out: Path) -> tuple[list[Path], list[Path]]:
    """(files an earlier ``prepare`` wrote into ``out``, every other file there). Ours: what
    its ``meta.json`` lists (shards, a ``tokenizer.json`` it names), or, in a ``meta.json``
    written before shards were listed, files named as shards are (``train_000000.bin``)."""
    present = sorted(p for p in out.iterdir())
    meta_file = out / "meta.json"
    if not meta_file.is_file():
        return [], present
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        listed = meta.get("shards")
        if isinstance(listed, dict):
            names = {str(n) for split in listed.values() for n in split}
        else:
            names = {p.name for p in present if SHARD_NAME.fullmatch(p.name)}
        if meta.get("tokenizer") == "tokenizer.json":
            names |= {"tokenizer.json", CONFIG_NAME}
    except (ValueError, AttributeError, TypeError):
        return [], present  # not a meta.json of ours: nothing there is ours to remove
    names.add("meta.json")
    ours = [p for p in present if p.name in names and p.is_file() and not p.is_symlink()]
    return ours, [p for p in present if p not in ours]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="mode-prepare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("inputs", nargs="+", help="text files or globs ('shakespeare': the embedded corpus)")
    parser.add_argument("--out", required=True, help="the directory to write (data.source for mode-train)")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--bpe", type=int, default=0, metavar="VOCAB", help="train a byte-level BPE of this size")
    how.add_argument("--tokenizer", default="bytes", help="bytes, a tokenizer.json, or a directory holding one")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--shard-tokens", type=int, default=100_000_000)
    parser.add_argument("--cache-dir", default="data", help="where the embedded corpus is cached")
    parser.add_argument(
        "--chunk-chars", type=int, default=CHUNK_CHARS, help="characters of text per encode call (bounds the memory)"
    )
    parser.add_argument(
        "--keep-other-files", action="store_true", help="write into a directory holding other files (left alone)"
    )
    args = parser.parse_args(argv)
    try:
        meta = prepare(
            args.inputs,
            args.out,
            args.tokenizer,
            args.bpe,
            args.val_fraction,
            args.shard_tokens,
            args.cache_dir,
            keep_other_files=args.keep_other_files,
            chunk_chars=args.chunk_chars,
        )
    except FileExistsError as e:
        raise SystemExit(f"mode-prepare: {e}") from None
    print(
        f"{args.out}: {meta['train_tokens']} train + {meta['val_tokens']} val ids, vocabulary {meta['vocab_size']} "
        f"({meta['tokenizer']}), {meta['bytes_per_token']:.3f} bytes per token"
    )
    if meta["tokenizer"] != "bytes":
        joined = "documents joined by it" if meta["eos_id"] is not None else "documents joined with no separator"
        print(f"end of text: {meta['eos']} ({joined})")


if __name__ == "__main__":
    from mode.cli import run

    run("mode-prepare", main)
