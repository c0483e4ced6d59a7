"""Tokenizers: bytes (the default, vocabulary 256) or a Hugging Face ``tokenizers`` BPE.

``load_tokenizer(spec)``: ``"bytes"``, a ``tokenizer.json`` file, or a directory holding one
(a Hugging Face model directory, or a directory ``mode-prepare`` wrote). ``train_bpe`` trains a
byte-level BPE on text files, offline. Both kinds share ``encode(text) -> list[int]``,
``decode(ids) -> str``, ``vocab_size`` and ``eos_id`` (the end-of-text id, or None: the token
a ``tokenizer_config.json`` beside the ``tokenizer.json`` declares, else one of the usual names).

``tokenizers`` comes with the ``hf`` extra; bytes need nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch

from mode.checks import read_json_object

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
    eos_id = eos_token = None
    eos_how = "none: bytes have no end-of-text id"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    decode_text = decode


END_OF_TEXT_NAMES = (EOT, "</s>", "<eos>", "<|end_of_text|>")  # tried when none is declared
CONFIG_NAME = "tokenizer_config.json"  # beside a tokenizer.json: its declared special tokens


class BPETokenizer:
    """A ``tokenizers.Tokenizer`` (a ``tokenizer.json``); ``name`` is the file it came from.
    ``eos_id``: the id of ``eos_token`` (declared: ``tokenizer_config.json``'s), else of the
    first of ``END_OF_TEXT_NAMES`` the vocabulary holds, else None; ``eos_how`` says which."""

    def __init__(self, tokenizer, name: str, eos_token: str | None = None) -> None:
        self.tokenizer, self.name = tokenizer, name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id, self.eos_token, self.eos_how = None, None, "none: the tokenizer declares no end-of-text token"
        if eos_token is not None and tokenizer.token_to_id(eos_token) is not None:
            self.eos_id, self.eos_token = tokenizer.token_to_id(eos_token), eos_token
            self.eos_how = f"{eos_token!r}, declared in {CONFIG_NAME}"
            return
        for token in END_OF_TEXT_NAMES:
            if tokenizer.token_to_id(token) is not None:
                self.eos_id, self.eos_token, self.eos_how = tokenizer.token_to_id(token), token, f"{token!r}, by name"
                return

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def decode_text(self, ids: Iterable[int]) -> str:
        """The text of ``ids`` without special tokens (what bits per byte count)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, path: str | Path) -> None:
        """``path``: the ``tokenizer.json``; its end-of-text token, when it has one, is declared
        in ``tokenizer_config.json`` beside it (as Hugging Face directories declare it)."""
        self.tokenizer.save(str(path))
        if self.eos_token is not None:
            write_tokenizer_config(Path(path).parent, eos_token=self.eos_token)


def write_tokenizer_config(directory: Path, **fields) -> None:
    """``directory/tokenizer_config.json``: the class ``AutoTokenizer`` builds for a
    ``tokenizer.json`` and ``fields`` (e.g. ``eos_token``, ``model_max_length``)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **fields}
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def declared_token(tokenizer_file: Path, field: str = "eos_token") -> str | None:
    """The token the ``tokenizer_config.json`` beside ``tokenizer_file`` declares as ``field``
    (a string, or an added-token object's ``content``), or None when there is no such file or
    field. ``ValueError`` naming the file when it is not a JSON object or too large for one."""
    config = tokenizer_file.parent / CONFIG_NAME
    if not config.is_file():
        return None
    token = read_json_object(config).get(field)
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def vocabulary(tokenizer: ByteTokenizer | BPETokenizer) -> dict[str, int] | str:
    """What fixes a tokenizer's ids: "bytes", or a BPE's token -> id map (added tokens too).
    Two tokenizers with equal vocabularies give a text the same ids' meaning."""
    if isinstance(tokenizer, ByteTokenizer):
        return "bytes"
    return tokenizer.tokenizer.get_vocab(with_added_tokens=True)


def same_tokenizer(given: str | Path, expected: str | Path) -> bool:
    """Whether the tokenizers ``given`` and ``expected`` (``load_tokenizer`` specs) give a text
    the same ids (equal ``vocabulary``)."""
    return vocabulary(load_tokenizer(given)) == vocabulary(load_tokenizer(expected))


def check_same_tokenizer(given: str | Path, expected: str | Path, what: str, fix: str) -> None:
    """``ValueError`` when the tokenizers ``given`` and ``expected`` (``load_tokenizer`` specs)
    map tokens to different ids: ``what`` names the one ``expected`` belongs to, ``fix`` the way out."""
    a, b = load_tokenizer(given), load_tokenizer(expected)
    va, vb = vocabulary(a), vocabulary(b)
    if va == vb:
        return
    sizes = f"{a.vocab_size} vs {b.vocab_size} tokens"
    if isinstance(va, dict) and isinstance(vb, dict):
        differ = len(set(va.items()) ^ set(vb.items()))
        sizes += f", {differ} token/id pairs differ"
    raise ValueError(f"the tokenizer {a.name} is not {what}'s ({b.name}): {sizes}; {fix}")


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
    return BPETokenizer(HFTokenizer.from_file(str(path)), str(path), declared_token(path))


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
