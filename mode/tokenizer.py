"""Tokenizers: bytes (the default, vocabulary 256) or a Hugging Face ``tokenizers`` BPE.

``load_tokenizer(spec)``: ``"bytes"``, a ``tokenizer.json`` file, or a directory holding one
(a Hugging Face model directory, or a directory ``mode-prepare`` wrote). ``train_bpe`` trains a
byte-level BPE on text files, offline. Both kinds share ``encode(text) -> list[int]``,
``decode(ids) -> str``, ``vocab_size`` and ``eos_id`` (the end-of-text id, or None).

``tokenizers`` comes with the ``hf`` extra; bytes need nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch

EOT = "<|endoftext|>"


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def decode_text(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; no end-of-text id."""

    name = "bytes"
    vocab_size = 256
    eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    decode_text = decode


class BPETokenizer:
    """A ``tokenizers.Tokenizer`` (a ``tokenizer.json``); ``name`` is the file it came from."""

    def __init__(self, tokenizer, name: str) -> None:
        self.tokenizer, self.name = tokenizer, name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        ends = (tokenizer.token_to_id(t) for t in (EOT, "</s>", "<eos>"))
        self.eos_id = next((i for i in ends if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def decode_text(self, ids: Iterable[int]) -> str:
        """The text of ``ids`` without special tokens (what bits per byte count)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, path: str | Path) -> None:
        self.tokenizer.save(str(path))


def load_tokenizer(spec: str | Path) -> ByteTokenizer | BPETokenizer:
    """``"bytes"``, a ``tokenizer.json`` or a directory holding one -> its tokenizer."""
    if str(spec) == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer {str(spec)!r}: no such tokenizer.json (give 'bytes', a tokenizer.json, or a directory "
            "holding one: a Hugging Face model directory or a mode-prepare output)"
        )
    try:
        from tokenizers import Tokenizer as HFTokenizer  # noqa: PLC0415  (the hf extra)
    except ImportError as e:
        raise ImportError("a tokenizer.json needs the tokenizers package: pip install 'mode-moe[hf]'") from e
    return BPETokenizer(HFTokenizer.from_file(str(path)), str(path))


def train_bpe(files: list[str | Path], vocab_size: int) -> BPETokenizer:
    """A byte-level BPE of ``vocab_size`` ids (``<|endoftext|>`` included, id 0) trained on
    the text ``files``, offline."""
    from tokenizers import Tokenizer as HFTokenizer  # noqa: PLC0415
    from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs more than the 256 bytes + end of text")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in files], trainer)
    return BPETokenizer(tok, f"bpe-{vocab_size}")


def encode_prompt(tokenizer: Tokenizer, text: str) -> torch.Tensor:
    """``text`` as a [1, T] int64 tensor of ids (the end-of-text id when it encodes to nothing)."""
    ids = tokenizer.encode(text) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    if not ids:
        raise ValueError("the prompt encodes to no token: give a non-empty prompt")
    return torch.tensor(ids, dtype=torch.long).unsqueeze(0)
