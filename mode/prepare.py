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
"""

from __future__ import annotations

import argparse
import glob
import json
import re
from pathlib import Path

import numpy as np

from mode.data import prepare_shakespeare, text_bytes_per_token
from mode.tokenizer import CONFIG_NAME, ByteTokenizer, load_tokenizer, train_bpe

__all__ = ["main", "prepare"]


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


def prepare(
    inputs: list[str],
    out: str | Path,
    tokenizer: str = "bytes",
    bpe_vocab: int = 0,
    val_fraction: float = 0.05,
    shard_tokens: int = 100_000_000,
    cache_dir: str = "data",
    keep_other_files: bool = False,
) -> dict:
    """Tokenize ``inputs`` into ``out`` (see the module docstring); returns the meta dict.
    ``bpe_vocab > 0`` trains a BPE of that size instead of using ``tokenizer``.

    A directory prepared before is prepared again in place: only the files its ``meta.json``
    lists (shards, tokenizer, ``meta.json``) are removed. A directory holding any other file is
    refused (``FileExistsError``) unless ``keep_other_files``, which leaves those files alone."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction}: must be in (0, 1)")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens}: must be >= 1")
    files = _input_files(inputs, cache_dir)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
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
    ids: list[int] = []
    for i, f in enumerate(files):
        if i and tok.eos_id is not None:
            ids.append(tok.eos_id)
        ids.extend(tok.encode(f.read_text(encoding="utf-8")))
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    suffix = ".bin" if dtype == np.uint16 else ".u32"
    tokens = np.asarray(ids, dtype=dtype)
    n_val = max(1, int(len(tokens) * val_fraction))
    if len(tokens) - n_val < 1:
        raise ValueError(f"the inputs encode to {len(tokens)} ids: too few to split")
    counts, shards = {}, {}
    for name, part in (("train", tokens[:-n_val]), ("val", tokens[-n_val:])):
        shards[name] = []
        for k, start in enumerate(range(0, len(part), shard_tokens)):
            shards[name].append(f"{name}_{k:06d}{suffix}")
            part[start : start + shard_tokens].tofile(out / shards[name][-1])
        counts[f"{name}_tokens"] = len(part)
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
        "bytes_per_token": text_bytes_per_token(tok, tokens[-n_val:]),
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
