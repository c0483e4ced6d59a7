"""The files of a Hugging Face export that describe tokens: the tokenizer, its special tokens'
ids in ``config.json``, and ``generation_config.json``, so that ``AutoTokenizer`` loads the
export and ``generate`` stops at end of text.

``write_token_files(out, tokenizer, vocab_size, seq_len)`` writes them for ``tokenizer``, a
``load_tokenizer`` spec:

- a directory (a Hugging Face model directory, or one ``mode-prepare`` wrote): every file of
  ``TOKEN_FILES`` it holds is copied (a round trip keeps them all), and the special ids are
  its ``config.json``'s where it has them;
- a ``tokenizer.json``: it, and the ``tokenizer_config.json`` beside it when there is one;
- ``"bytes"``: a byte-level ``tokenizer.json`` whose ids are the bytes' values (256 ids, no
  end of text), which ``AutoTokenizer`` encodes exactly as ``mode.tokenizer.ByteTokenizer``.

``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` are always written (null when none is
known), so a transformers class's own defaults (e.g. OLMoE's ``eos_token_id`` 50279, outside a
small vocabulary) never stand in for them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mode.checks import read_json_object
from mode.config import Config
from mode.convert import is_hf, published_dir
from mode.data import source_tokenizer
from mode.tokenizer import (
    CONFIG_NAME,
    BPETokenizer,
    ByteTokenizer,
    declared_token,
    load_tokenizer,
    same_tokenizer,
    write_tokenizer_config,
)

__all__ = [
    "SPECIAL_IDS",
    "TOKEN_FILES",
    "byte_level_tokenizer",
    "checked_tokenizer",
    "export_tokenizer",
    "write_token_files",
]

# the files of a Hugging Face directory that describe tokens (copied as they are)
TOKEN_FILES = (
    "tokenizer.json",
    CONFIG_NAME,
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "generation_config.json",
)
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character map (byte-level BPE's alphabet), by byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]


def byte_level_tokenizer():
    """A ``tokenizers.Tokenizer`` whose ids are UTF-8 bytes' values (``ByteTokenizer``'s ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415  (the hf extra)

    tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(_byte_chars())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _valid_id(value: object, vocab_size: int) -> bool:
    if isinstance(value, list):
        return bool(value) and all(_valid_id(v, vocab_size) for v in value)
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _source_ids(directory: Path, vocab_size: int) -> dict:
    """The special ids a Hugging Face directory's ``config.json`` declares (those that are ids
    of ``vocab_size``)."""
    config = directory / "config.json"
    try:
        fields = read_json_object(config) if config.is_file() else {}
    except ValueError:  # not ours to judge here: from_hf names it when the model is read
        return {}
    return {k: fields[k] for k in SPECIAL_IDS if _valid_id(fields.get(k), vocab_size)}


def _declared_id(tok: ByteTokenizer | BPETokenizer, field: str) -> int | None:
    """The id of the token ``tokenizer_config.json`` declares as ``field`` (e.g. "bos_token")."""
    if isinstance(tok, ByteTokenizer):
        return None
    token = declared_token(Path(tok.name), field)  # the file was read when tok was loaded
    return tok.tokenizer.token_to_id(token) if token is not None else None


def _copy(source: Path, out: Path) -> None:
    if source.is_symlink() or not source.is_file():
        return
    if source.resolve() != (out / source.name).resolve():
        shutil.copyfile(source, out / source.name)


def export_tokenizer(cfg: Config) -> str | Path | None:
    """The tokenizer a trained run's export carries: the published model's directory it
    started from (``train.init_from=hf:<dir>``, when that directory still holds the run's
    tokenizer: its every token file is kept), else the run's data's (``"bytes"`` or a
    ``tokenizer.json``); None for token files of no known tokenizer."""
    spec = source_tokenizer(cfg.data.source, cfg.data.tokenizer)
    if spec is not None and is_hf(cfg.train.init_from):
        published = published_dir(cfg.train.init_from)
        if (published / "tokenizer.json").is_file() and same_tokenizer(published, spec):
            return published
    return spec


def checked_tokenizer(tokenizer: str | Path, vocab_size: int) -> ByteTokenizer | BPETokenizer:
    """``load_tokenizer(tokenizer)``; ``ValueError`` when it has more ids than the model."""
    tok = load_tokenizer(tokenizer)
    if tok.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer {tok.name} has {tok.vocab_size} ids, more than the model's {vocab_size}")
    return tok


def write_token_files(
    out: Path, tokenizer: str | Path, tok: ByteTokenizer | BPETokenizer, vocab_size: int, seq_len: int
) -> dict:
    """Write ``tokenizer``'s files (``tok``: it, loaded by ``checked_tokenizer``) into the
    export ``out`` (see the module docstring) and return the special ids for its
    ``config.json`` (each key of ``SPECIAL_IDS``, None when unknown)."""
    source = Path(str(tokenizer))
    home = source if source.is_dir() else source.parent  # where the tokenizer's files are
    if isinstance(tok, ByteTokenizer) or home.resolve() != out.resolve():
        for name in TOKEN_FILES:  # an earlier export's token files are replaced, never mixed in
            if (out / name).is_file() or (out / name).is_symlink():
                (out / name).unlink()
    ids = dict.fromkeys(SPECIAL_IDS)
    if isinstance(tok, ByteTokenizer):
        byte_level_tokenizer().save(str(out / "tokenizer.json"))
    elif source.is_dir():
        for name in TOKEN_FILES:
            _copy(source / name, out)
        ids |= _source_ids(source, vocab_size)
    else:
        _copy(source, out)
        if source.name != "tokenizer.json":
            shutil.move(out / source.name, out / "tokenizer.json")
        _copy(source.parent / CONFIG_NAME, out)
    if not (out / CONFIG_NAME).is_file():  # AutoTokenizer needs to be told the class
        declared = {"eos_token": tok.eos_token} if tok.eos_token is not None else {}
        write_tokenizer_config(out, model_max_length=seq_len, **declared)
    if ids["eos_token_id"] is None:
        ids["eos_token_id"] = tok.eos_id
    if ids["bos_token_id"] is None:
        ids["bos_token_id"] = _declared_id(tok, "bos_token")
    if not (out / "generation_config.json").is_file():
        generation = {k: v for k, v in ids.items() if v is not None}
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    return ids
