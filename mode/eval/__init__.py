"""Evaluate and sample a trained model: ``mode-eval`` and ``mode-generate``.

    mode-eval runs/mod/ckpt.pt                       # the checkpoint's own data and tokenizer
    mode-eval path/to/llama --data data/tok          # a Hugging Face directory on prepared data
    mode-generate runs/mod/ckpt.pt --prompt "ROMEO:" --max-new-tokens 200 --top-p 0.9

``mode-eval`` reads the whole validation split once (a text's last ``data.val_fraction``,
said with its share; ``--whole``: every token), in consecutive windows of ``seq_len``
(every token predicted once, the last partial window left out), and reports the loss per
token, bits per byte (bits per token when the data's bytes per token are unknown) and each
routing metric's mean, in top-k routing and, for a model whose layers decide per token, in
causal routing; ``--json`` writes the same numbers. A ``--tokenizer`` whose ids differ from
the model's own tokenizer is refused.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import torch

from mode.evaluation import consecutive_windows, evaluate_batches
from mode.model import MoDETransformer
from mode.tokenizer import ByteTokenizer, check_same_tokenizer, encode_prompt, load_tokenizer

__all__ = ["evaluate_split", "load_model", "main_eval", "main_generate"]


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[MoDETransformer, dict]:
    """A model from a ``mode-train`` checkpoint (``ckpt.pt`` or ``ckpt/``) or a Hugging Face
    directory, in eval mode, and what it says about its data: ``{"source", "tokenizer",
    "val_fraction"}`` (a Hugging Face directory: its own ``tokenizer.json`` if any). The
    checkpoint's ``data.cache_dir`` is not returned: a file never picks where we write."""
    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file() and not (path / ".metadata").exists():
        from mode.hf import from_hf  # noqa: PLC0415

        tok = str(path) if (path / "tokenizer.json").is_file() else None
        return from_hf(path, dtype), {"source": None, "tokenizer": tok, "val_fraction": 0.05}
    from mode.checkpoint import checkpoint_config  # noqa: PLC0415
    from mode.data import source_tokenizer  # noqa: PLC0415

    data = checkpoint_config(path).data
    model = MoDETransformer.from_checkpoint(path).to(dtype)
    return model, {
        "source": data.source,
        "tokenizer": source_tokenizer(data.source, data.tokenizer),
        "val_fraction": data.val_fraction,
    }


def evaluate_split(
    model: MoDETransformer, tokens, batch_size: int = 8, routing: str = "topk", max_batches: int = 0
) -> tuple[float, int, dict[str, float]]:
    """Mean cross-entropy (nats/token) over consecutive ``seq_len`` windows of ``tokens`` (a
    1-D id array), the number of tokens predicted, and each scalar routing metric's mean over
    the batches. ``max_batches > 0`` stops early (``mode.evaluation``, training's loop too)."""
    batches = consecutive_windows(tokens, model.cfg.seq_len, batch_size, max_batches)
    done = evaluate_batches(model, batches, routing)
    return done.loss, done.tokens, done.metrics


def main_eval(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="mode-eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", help="a mode-train checkpoint (ckpt.pt or ckpt/) or a Hugging Face directory")
    parser.add_argument("--data", default=None, help="data.source to evaluate on (default: the checkpoint's)")
    parser.add_argument("--tokenizer", default=None, help="data.tokenizer for a text source (default: the model's)")
    parser.add_argument(
        "--cache-dir", default="data", help="where a named corpus is fetched to (default: data; never the checkpoint's)"
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-batches", type=int, default=0, help="stop after this many batches (0: the whole split)")
    parser.add_argument(
        "--whole", action="store_true", help="score every token of the data (default: its validation split)"
    )
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    from mode.data import load_corpus, text_bytes_per_token  # noqa: PLC0415

    model, data = load_model(args.model)
    source = args.data or data["source"]
    if source is None:
        parser.error("a Hugging Face directory names no data: give --data")
    if args.tokenizer is not None and data["tokenizer"] is not None:
        fix = "leave out --tokenizer (the model's is used) or prepare the data with the model's tokenizer"
        check_same_tokenizer(args.tokenizer, data["tokenizer"], f"the model {args.model}", fix)
    tokenizer = args.tokenizer or (data["tokenizer"] if args.data is None or Path(source).is_file() else None)
    corpus = load_corpus(source, model.cfg.seq_len, data["val_fraction"], args.cache_dir, tokenizer or "bytes")
    if corpus.vocab_size > model.cfg.vocab_size:
        raise SystemExit(
            f"mode-eval: the data's ids need {corpus.vocab_size} > model.vocab_size={model.cfg.vocab_size}"
        )
    tokens, per_token = corpus.val.tokens, corpus.bytes_per_token
    total = len(corpus.train.tokens) + len(tokens)
    if args.whole:
        tokens = np.concatenate([np.asarray(corpus.train.tokens), np.asarray(tokens)])
        if corpus.tokenizer not in (None, "bytes"):  # bytes per token of the whole text, not the split's
            per_token = text_bytes_per_token(load_tokenizer(corpus.tokenizer), tokens)
        print(f"{source}: every token, {total} ids")
    else:
        print(
            f"{source}: the validation split, {len(tokens)} of {total} ids ({len(tokens) / total:.1%}, the "
            "last ones); --whole scores every token"
        )
    results = {"model": str(args.model), "data": source, "tokenizer": corpus.tokenizer}
    results["split"] = "whole" if args.whole else "val"
    routings = ["topk", "causal"] if model.supports_causal() else ["topk"]
    for routing in routings:
        loss, n, metrics = evaluate_split(model, tokens, args.batch_size, routing, args.max_batches)
        bits = loss / math.log(2)
        row = {"loss": loss, "tokens": n, "bits_per_token": bits, "metrics": metrics}
        if per_token:
            row["bits_per_byte"] = bits / per_token
        results[routing] = row
        per_byte = f", {row['bits_per_byte']:.4f} bits/byte" if "bits_per_byte" in row else ""
        print(f"{routing:>6} routing: loss {loss:.4f} nats/token over {n} tokens ({bits:.4f} bits/token{per_byte})")
        for key, value in sorted(metrics.items()):
            print(f"{'':8}{key}: {value:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


def main_generate(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="mode-generate", description="Sample text from a trained model.")
    parser.add_argument("model", help="a mode-train checkpoint (ckpt.pt or ckpt/) or a Hugging Face directory")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="\n", help=r"the text to continue (\n and \t mean a newline and a tab)")
    prompt.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 file ('-': stdin)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the smallest set of mass >= p")
    parser.add_argument(
        "--tokenizer", default=None, help="bytes, a tokenizer.json or a directory (default: the model's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model, data = load_model(args.model)
    spec = args.tokenizer or data["tokenizer"]
    if spec is None:
        parser.error("the model names no tokenizer: give --tokenizer")
    tok = load_tokenizer(spec)
    torch.manual_seed(args.seed)
    prompt = encode_prompt(tok, read_prompt(args.prompt, args.prompt_file))
    if tok.eos_id is None and not isinstance(tok, ByteTokenizer):
        print(
            f"mode-generate: {tok.name} declares no end-of-text token: all {args.max_new_tokens} tokens are sampled",
            file=sys.stderr,
        )
    out = model.generate(prompt, args.max_new_tokens, args.temperature, args.top_k, top_p=args.top_p, eos_id=tok.eos_id)
    text = tok.decode(out[0].tolist())
    print(text)
    return text


def read_prompt(prompt: str, prompt_file: str | None) -> str:
    """The prompt ``mode-generate`` continues: ``prompt_file``'s text (UTF-8; "-" reads
    stdin) or ``prompt`` with the escapes a shell cannot type plainly (``\\n``, ``\\t``,
    ``\\\\``) read as the characters they name."""
    if prompt_file == "-":
        return sys.stdin.read()
    if prompt_file is not None:
        try:
            return Path(prompt_file).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"--prompt-file {prompt_file}: not UTF-8 text ({e})") from e
    escapes = {"n": "\n", "t": "\t", "\\": "\\"}
    return re.sub(r"\\([nt\\])", lambda m: escapes[m.group(1)], prompt)
