"""Hugging Face checkpoint directories in and out: ``from_hf(dir)`` and ``to_hf(model, dir)``,
driving the family adapters of ``mode.hf.registry`` (see the package docstring)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

from mode.checks import ConfigError
from mode.config import ModelConfig, from_dict, to_dict
from mode.hf.family import Family
from mode.hf.files import (
    StateDict,
    Tensors,
    UnsupportedCheckpoint,
    hf_config,
    read_hf_state,
    refuse,
    remove_stale_export,
)
from mode.hf.gpt2 import is_gpt2_arch
from mode.hf.llama import is_llama_arch
from mode.hf.registry import FAMILIES, WRITTEN
from mode.hf_tokens import SPECIAL_IDS, checked_tokenizer, write_token_files
from mode.model import MoDETransformer

OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings", "n_inner", "decoder_sparse_step")


def config_from_hf(c: dict) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face ``config.json`` (dict); ``UnsupportedCheckpoint``
    naming every field it cannot represent."""
    family = c.get("model_type")
    if not isinstance(family, str) or family not in FAMILIES:
        raise UnsupportedCheckpoint(
            f"model_type={family!r} is not supported: the families read are {list(FAMILIES)}" + _family_hint(family)
        )
    _check_sizes(c, family)
    problems: list[str] = []
    model = FAMILIES[family].config_in(c, problems)
    refuse(f"config.json (model_type={family!r})", problems)
    try:
        return from_dict({"model": model}).model
    except ConfigError as e:
        raise UnsupportedCheckpoint(f"config.json (model_type={family!r}) gives an invalid model: {e}") from e


def _check_sizes(c: dict, family: str) -> None:
    """``UnsupportedCheckpoint`` naming every size field of ``family`` that is missing or not a
    positive int (the family's ``sizes``; ``OPTIONAL_SIZES`` where present and not null)."""
    present = [n for n in OPTIONAL_SIZES if c.get(n) is not None]
    bad = [
        f"{n}={c[n]!r}" if n in c else f"{n} missing"
        for n in (*FAMILIES[family].sizes, *present)
        if isinstance(c.get(n), bool) or not isinstance(c.get(n), int) or c[n] <= 0
    ]
    if bad:
        raise UnsupportedCheckpoint(
            f"config.json (model_type={family!r}): {', '.join(bad)}: each must be a positive int; the file is "
            f"damaged or not a {family} config (write it again with transformers' save_pretrained)"
        )


def _family_hint(family: str | None) -> str:
    hints = {
        "qwen3": ": it normalizes each head's queries and keys (q_norm, k_norm over head_dim); mode's qk_norm "
        "normalizes all heads at once (OLMoE)",
    }
    return hints.get(family or "", "")


def from_hf(path: str | Path, dtype: torch.dtype = torch.float32) -> MoDETransformer:
    """The ``MoDETransformer`` of a Hugging Face checkpoint directory (see the module
    docstring), in ``dtype``, in evaluation mode. Every tensor of the checkpoint is used and
    every parameter filled, or ``UnsupportedCheckpoint`` names the keys."""
    c = hf_config(path)
    state = read_hf_state(path)
    if c.get("model_type") == "mode_moe":  # written by to_hf with its modeling file: our own names
        if not isinstance(c.get("mode_config"), dict):
            raise UnsupportedCheckpoint(
                f"{path}/config.json has model_type 'mode_moe' but no mode_config object (the model's "
                "config, written by mode-export): export the model again"
            )
        try:
            cfg = from_dict({"model": c["mode_config"]}).model
        except ConfigError as e:
            raise UnsupportedCheckpoint(f"{path}/config.json: its mode_config is not a valid model: {e}") from e
        ours = {k.removeprefix("model."): v for k, v in state.items()}
    else:
        cfg = config_from_hf(c)
        ours = state_from_hf(state, cfg, c["model_type"])
    with torch.device("meta"):  # the config's shapes, compared to the file's before any memory is spent
        _check_exactly(MoDETransformer(cfg), ours, f"{path}")
    model = MoDETransformer(cfg)
    model.load_state_dict(ours, strict=False)
    return model.to(dtype).eval()


def _check_exactly(model: MoDETransformer, state: StateDict, where: str) -> None:
    """``UnsupportedCheckpoint`` unless ``state`` fills every parameter of ``model`` (which may
    live on the meta device: only shapes and dtypes are compared) with a tensor of its shape
    and a floating dtype, and holds nothing else."""
    own = model.state_dict()
    params = {k for k in own if not k.endswith("selection_bias")}
    missing = sorted(params - state.keys())
    if model.cfg.tie_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    unexpected = sorted(state.keys() - own.keys())
    problems = [f"parameters the checkpoint lacks: {missing}"] if missing else []
    problems += [f"checkpoint tensors with no place here: {unexpected}"] if unexpected else []
    for k, v in state.items():
        if k in own and own[k].shape != v.shape:
            problems.append(f"{k}: shape {tuple(v.shape)} in the checkpoint, {tuple(own[k].shape)} here")
        elif k in own and own[k].is_floating_point() and not v.is_floating_point():
            problems.append(f"{k} is stored as {v.dtype}, not a floating dtype (it would be cast in silence)")
    refuse(where, problems)


def state_from_hf(state: StateDict, cfg: ModelConfig, family: str) -> StateDict:
    """A Hugging Face state dict (of ``family``) as this library's parameter names and layouts."""
    adapter = FAMILIES[family]
    tensors = Tensors(state, adapter.prefix)
    out = adapter.state_in(tensors, cfg)
    tensors.check_all_taken()
    return out


# --- writing ----------------------------------------------------------------------------------


def exporting_family(cfg: ModelConfig) -> Family:
    """The first family of the registry (in its order) that holds ``cfg``'s model (Llama
    holds any other dense model, Mixtral any other MoE; ``hf_family`` says what they refuse)."""
    return next(family for family in (FAMILIES[name] for name in WRITTEN) if family.holds(cfg))


def hf_family(cfg: ModelConfig) -> str:
    """The Hugging Face family a model config exports to; ``UnsupportedCheckpoint`` naming
    every field that keeps it from one."""
    kinds = set(cfg.block_kinds())
    family = exporting_family(cfg)
    mixed = "moe" in kinds and kinds <= {"dense", "moe"} and family.mixed_layouts
    problems = []
    if kinds - {"dense", "moe"} or (len(kinds) > 1 and not mixed):
        problems.append(
            f"model.layout={cfg.layout!r}: transformers has no depth-routed (MoD/MoDE) or mixed-layout model "
            "(but Qwen2-MoE's, whose MoE has a gated shared expert); export supports layout 'dense' or 'moe'"
        )
    if not (is_gpt2_arch(cfg) or is_llama_arch(cfg)):
        problems.append(
            f"architecture norm={cfg.norm}, mlp={cfg.mlp}, bias={cfg.bias}, positions={cfg.positions}: export needs "
            "GPT-2's (layernorm, gelu_tanh, bias=true, learned) or Llama's (rmsnorm, swiglu, bias=false, rope)"
        )
    if cfg.early_exit.enabled:
        problems.append("model.early_exit.enabled=true: an exited token skips later blocks that transformers runs")
    if cfg.qk_norm and "moe" not in kinds:
        problems.append("model.qk_norm=true: of the families only OLMoE (an MoE) normalizes queries and keys")
    problems += family.export_problems(cfg)
    refuse(f"model (layout {cfg.layout!r})", problems)
    return family.name


def _native_family(model: MoDETransformer) -> str:
    """``hf_family`` of the model, also refusing a non-zero aux-loss-free selection bias."""
    family = hf_family(model.cfg)
    biases = [m.selection_bias for m in model.modules() if hasattr(m, "selection_bias")]
    if FAMILIES[family].moe and any(b.any() for b in biases):
        refuse("model", [f"the MoE selection bias (model.moe.bias_rate) is not zero: {family}'s router has none"])
    return family


def to_hf(
    model: MoDETransformer,
    path: str | Path,
    native: bool | None = None,
    routing: str | None = None,
    tokenizer: str | Path | None = None,
) -> Path:
    """Write ``model`` as a Hugging Face checkpoint directory (``config.json`` +
    ``model.safetensors``, and ``modeling_mode.py`` when no family holds it) that
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads with this model's logits;
    returns the directory. ``native``: None picks the family when one holds the model, else
    the modeling file; True refuses (``UnsupportedCheckpoint`` naming every field) what no
    family holds; False always writes the modeling file, whose forward uses ``routing``
    ("topk" or "causal"; default ``model.default_routing()``, as ``mode-generate`` and the
    lm-eval model: causal where the model can decide per token). A model a family holds
    routes no depth, so both routings are its one forward. ``tokenizer`` (a ``load_tokenizer``
    spec: "bytes", a ``tokenizer.json``, a directory) is written beside the weights with its
    special ids in ``config.json`` and a ``generation_config.json`` (``mode.hf_tokens``);
    without one the ids are null. Nothing is written when it refuses."""
    from safetensors.torch import save_file  # noqa: PLC0415  (the hf extra)

    routing = routing or model.default_routing()
    if routing not in ("topk", "causal"):
        raise ValueError(f"routing={routing!r}: choose 'topk' or 'causal'")
    if routing == "causal" and not model.supports_causal():
        raise ValueError("routing='causal' needs a model whose routed layers decide per token (supports_causal)")
    cfg = model.cfg
    family = None
    if native is not False:
        try:
            family = _native_family(model)
        except UnsupportedCheckpoint:
            if native:
                raise
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    path = Path(path)
    if family is None:
        # a tied head is saved as its own copy (safetensors stores no shared tensors)
        theirs = {f"model.{k}": v.clone() if k == "lm_head.weight" else v for k, v in state.items()}
        config = _remote_config(cfg, routing, next(iter(theirs.values())).dtype)
    else:
        theirs = FAMILIES[family].state_out(state, cfg)
        config = FAMILIES[family].config_out(cfg, next(iter(theirs.values())).dtype)
    tok = checked_tokenizer(tokenizer, cfg.vocab_size) if tokenizer is not None else None  # before any write
    path.mkdir(parents=True, exist_ok=True)
    remove_stale_export(path)
    config |= dict.fromkeys(SPECIAL_IDS)  # never a transformers class's defaults
    if tok is not None:
        config |= write_token_files(path, tokenizer, tok, cfg.vocab_size, cfg.seq_len)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in theirs.items()}, path / "model.safetensors", metadata={"format": "pt"})
    if family is None:
        source = resources.files("mode") / "hf_modeling.py"
        (path / "modeling_mode.py").write_text(source.read_text())
    return path


def _remote_config(cfg: ModelConfig, routing: str, dtype: torch.dtype) -> dict:
    return {
        "model_type": "mode_moe",
        "architectures": ["MoDEForCausalLM"],
        "auto_map": {"AutoConfig": "modeling_mode.MoDEConfig", "AutoModelForCausalLM": "modeling_mode.MoDEForCausalLM"},
        "mode_config": to_dict(cfg),
        "routing": routing,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
