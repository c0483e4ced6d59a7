"""``mode-export``: a trained checkpoint written as a Hugging Face checkpoint directory."""

from __future__ import annotations

from mode.hf.checkpoint import to_hf
from mode.hf.files import UnsupportedCheckpoint, hf_config
from mode.model import MoDETransformer


def main(argv: list[str] | None = None) -> None:
    """``mode-export <checkpoint> <dir>``: a trained checkpoint (``ckpt.pt`` or a sharded
    ``ckpt/``) written as a Hugging Face checkpoint directory."""
    import argparse  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="mode-export", description=main.__doc__)
    parser.add_argument("checkpoint", help="ckpt.pt or a sharded ckpt/ directory written by mode-train")
    parser.add_argument("out_dir", help="the Hugging Face checkpoint directory to write")
    parser.add_argument("--native", action="store_true", help="refuse a model no transformers family holds")
    parser.add_argument(
        "--routing",
        default=None,
        choices=["topk", "causal"],
        help="the modeling file's routing (default: causal where the model can decide per token, as mode-generate)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="the tokenizer to write beside the weights: bytes, a tokenizer.json or a directory (default: the "
        "run's; the published model's directory it started from keeps all its token files)",
    )
    args = parser.parse_args(argv)
    from mode.checkpoint import checkpoint_config  # noqa: PLC0415
    from mode.hf_tokens import export_tokenizer  # noqa: PLC0415

    model = MoDETransformer.from_checkpoint(args.checkpoint)
    tokenizer = args.tokenizer or export_tokenizer(checkpoint_config(args.checkpoint))
    try:
        out = to_hf(model, args.out_dir, True if args.native else None, args.routing, tokenizer)
    except (UnsupportedCheckpoint, ValueError) as e:
        raise SystemExit(f"mode-export: {e}") from None
    config = hf_config(out)
    if config["model_type"] == "mode_moe":
        how = f"trust_remote_code=True, {config['routing']} routing"
    else:
        how = "no remote code"
    if tokenizer is None:
        said = "no tokenizer (the run's data are token ids of no known tokenizer: give --tokenizer)"
    else:
        said = f"tokenizer {tokenizer}, end of text id {config['eos_token_id']}"
    print(f"wrote {config['architectures'][0]} to {out} (AutoModelForCausalLM.from_pretrained, {how}); {said}")
