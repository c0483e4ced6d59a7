"""Hugging Face checkpoints in and out: ``from_hf(dir)`` and ``to_hf(model, dir)``.

A checkpoint directory holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). Reading needs ``safetensors`` only (``pip install
'mode-moe[hf]'``); ``transformers`` is not imported.

Families (``config.json``'s ``model_type``):

- ``llama``, ``mistral``, ``qwen2`` -> a dense model: RMSNorm, SwiGLU, grouped-query attention
  with RoPE (Qwen2 with query/key/value biases). Mistral's sliding window becomes the model's
  ``seq_len`` (within the window, sliding-window attention is full causal attention).
- ``gpt2`` -> a dense model: biased LayerNorm and linears, tanh-GELU MLP, learned positions,
  tied head (GPT-2's ``Conv1D`` weights are stored transposed).
- ``mixtral`` -> a ``moe`` layout: a softmax router over ``num_local_experts``, top
  ``num_experts_per_tok`` renormalized, SwiGLU experts (the per-expert ``w1/w2/w3`` layout
  and transformers 5's fused ``gate_up_proj``/``down_proj`` both read).
- ``olmoe`` -> a ``moe`` layout with query/key norms (``model.qk_norm``): a softmax router
  over ``num_experts``, top ``num_experts_per_tok`` renormalized when ``norm_topk_prob``.
- ``qwen2_moe`` -> Qwen2 attention, ``moe`` blocks with a gated shared expert
  (``moe.shared_d_ff``, ``moe.shared_gate``) and ``dense`` blocks at ``mlp_only_layers`` and
  between the ``decoder_sparse_step`` ones.

``to_hf`` writes dense models of the three architectures above and ``moe`` models as Mixtral,
in the per-expert layout every transformers version loads, so that
``AutoModelForCausalLM.from_pretrained(dir)`` computes this model's logits. Every other model
(MoD and MoDE layouts, which transformers has no block for, no-op, shared, capacity or
expert-choice experts, a non-zero aux-loss-free bias, architectures no family has such as
this library's default) is written with a modeling file, ``modeling_mode.py``
(``mode.hf_modeling``), that ``from_pretrained(dir, trust_remote_code=True)`` loads: it wraps
this library's own model (``mode-moe`` must be installed there), in top-k or causal routing.
``native=True`` refuses such a model instead, naming every field that keeps it from a family.

Also refused on reading, by field: RoPE scaling, a head dim other than
``hidden_size / num_attention_heads``, attention or MLP biases in Llama, sliding windows on
some layers only.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

from mode.checks import ConfigError, is_file_name, read_json_object
from mode.config import ModelConfig, from_dict, to_dict
from mode.hf_tokens import SPECIAL_IDS, checked_tokenizer, write_token_files
from mode.model import MoDETransformer

__all__ = ["UnsupportedCheckpoint", "config_from_hf", "from_hf", "hf_config", "hf_family", "read_hf_state", "to_hf"]

StateDict = dict[str, torch.Tensor]
# and "mode_moe": to_hf's modeling-file export
FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "mixtral", "olmoe", "qwen2_moe")
# the transformers class of each family this library writes
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
MOE_FAMILIES = ("mixtral", "olmoe", "qwen2_moe")
_LLAMA_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# The size fields of each family's config.json that must be positive ints (read before anything
# is built from them); OPTIONAL_SIZES must be too where present.
SIZES = {
    "gpt2": ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"),
    "mixtral": (*_LLAMA_SIZES, "num_local_experts", "num_experts_per_tok"),
    "olmoe": (*_LLAMA_SIZES, "num_experts", "num_experts_per_tok"),
    "qwen2_moe": (*_LLAMA_SIZES, "num_experts", "num_experts_per_tok", "moe_intermediate_size"),
} | {family: _LLAMA_SIZES for family in ("llama", "mistral", "qwen2")}
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings", "n_inner", "decoder_sparse_step")
# Parameter names, each table used both ways: Llama-family ``{name}_proj`` of a SwiGLU MLP ->
# this library's dense MLP (``mlp.<ours>``) and experts (``experts.<ours>``, transposed) ...
DENSE_MLP = (("gate", "fc"), ("up", "up"), ("down", "proj"))
EXPERT_MLP = (("gate", "w1"), ("up", "w3"), ("down", "w2"))
# ... and GPT-2's blocks: (ours, theirs, transposed: Conv1D stores [in, out]), each with a bias
GPT2_BLOCK = (
    ("norm1", "ln_1", False),
    ("attn.qkv", "attn.c_attn", True),
    ("attn.proj", "attn.c_proj", True),
    ("norm2", "ln_2", False),
    ("mlp.fc", "mlp.c_fc", True),
    ("mlp.proj", "mlp.c_proj", True),
)


class UnsupportedCheckpoint(ValueError):
    """A Hugging Face checkpoint or a model that the conversion cannot map exactly; the
    message names every field at fault."""


def _refuse(where: str, problems: list[str]) -> None:
    if problems:
        raise UnsupportedCheckpoint(f"{where} cannot be converted exactly:\n  - " + "\n  - ".join(problems))


# --- reading ----------------------------------------------------------------------------------


def hf_config(path: str | Path) -> dict:
    """``config.json`` of a checkpoint directory as a dict."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {path}: expected a Hugging Face checkpoint directory")
    return read_json_object(file, "write it again with save_pretrained", UnsupportedCheckpoint)


def read_hf_state(path: str | Path) -> StateDict:
    """Every tensor of a checkpoint directory: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` lists."""
    from safetensors.torch import load_file  # noqa: PLC0415  (the hf extra)

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = index_shards(index)
        if (path / "model.safetensors").is_file() and shards != ["model.safetensors"]:
            raise UnsupportedCheckpoint(
                f"{path} holds both model.safetensors and {index.name} (listing {', '.join(shards[:3])}"
                f"{', ...' if len(shards) > 3 else ''}): which is the model is ambiguous (a stale export?); "
                "remove the one that is not"
            )
    elif (path / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        found = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        raise FileNotFoundError(
            f"no model.safetensors or model.safetensors.index.json in {path} (found {found}): "
            "save the model with safe_serialization (transformers' default)"
        )
    state: StateDict = {}
    for shard in shards:
        if not (path / shard).is_file():
            raise FileNotFoundError(f"{path / shard} is missing (the index lists it): copy the whole model directory")
        try:
            state.update(load_file(path / shard))
        except Exception as e:  # noqa: BLE001  (safetensors raises its own SafetensorError, OSError, ...)
            raise UnsupportedCheckpoint(f"{path / shard} is not a readable safetensors file: {e}") from e
    return state


def index_shards(index: Path) -> list[str]:
    """The shard files a ``model.safetensors.index.json`` lists, sorted: plain file names in
    its directory only (``UnsupportedCheckpoint`` naming the entry otherwise)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise UnsupportedCheckpoint(f"{index} is not a safetensors index (no weight_map of names): {e!r}") from e
    for name in names:
        if not is_file_name(name):
            raise UnsupportedCheckpoint(f"{index} lists the shard {name!r}: only file names inside its directory")
    return names


def _remove_stale_export(path: Path) -> None:
    """Remove an earlier export's sharded weights from ``path``: its index and the shards it
    lists (a later reader would prefer them to the new ``model.safetensors``)."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return
    for name in index_shards(index):
        (path / name).unlink(missing_ok=True)
    index.unlink()


def _rope_base(c: dict, problems: list[str]) -> float:
    params = c.get("rope_parameters") or {}  # transformers 5
    scaling = c.get("rope_scaling") or {}  # transformers 4
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        problems.append(f"rope type {kind!r} (RoPE scaling): only plain RoPE is implemented")
    return float(params.get("rope_theta", c.get("rope_theta", 10000.0)))


def _check_heads(c: dict, problems: list[str]) -> None:
    d, h = c["hidden_size"], c["num_attention_heads"]
    if c.get("head_dim") not in (None, d // h):
        problems.append(f"head_dim={c['head_dim']}: heads here are hidden_size / num_attention_heads = {d // h}")
    kinds = set(c.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        problems.append(f"layer_types={sorted(kinds)}: every layer attends fully here")


def config_from_hf(c: dict) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face ``config.json`` (dict); ``UnsupportedCheckpoint``
    naming every field it cannot represent."""
    family = c.get("model_type")
    if family not in FAMILIES:
        raise UnsupportedCheckpoint(
            f"model_type={family!r} is not supported: the families read are {list(FAMILIES)}" + _family_hint(family)
        )
    _check_sizes(c, family)
    problems: list[str] = []
    if family == "gpt2":
        model = _gpt2_config(c, problems)
    else:
        model = _llama_config(c, family, problems)
    _refuse(f"config.json (model_type={family!r})", problems)
    try:
        return from_dict({"model": model}).model
    except ConfigError as e:
        raise UnsupportedCheckpoint(f"config.json (model_type={family!r}) gives an invalid model: {e}") from e


def _check_sizes(c: dict, family: str) -> None:
    """``UnsupportedCheckpoint`` naming every size field of ``family`` that is missing or not a
    positive int (``SIZES``; ``OPTIONAL_SIZES`` where present and not null)."""
    present = [n for n in OPTIONAL_SIZES if c.get(n) is not None]
    bad = [
        f"{n}={c[n]!r}" if n in c else f"{n} missing"
        for n in (*SIZES[family], *present)
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


def _llama_config(c: dict, family: str, problems: list[str]) -> dict:
    _check_heads(c, problems)
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r}: the SwiGLU MLP here uses silu")
    for name in ("attention_bias", "mlp_bias"):
        if c.get(name):
            problems.append(f"{name}=true: a Llama-family model here has biases on q, k, v (Qwen2) or none")
    seq_len = c.get("max_position_embeddings", 2048)
    window = c.get("sliding_window")
    if window and (family == "mistral" or c.get("use_sliding_window")):
        seq_len = min(seq_len, window)  # within the window, sliding-window attention is full attention
    model = {
        "vocab_size": c["vocab_size"],
        "seq_len": seq_len,
        "d_model": c["hidden_size"],
        "n_layers": c["num_hidden_layers"],
        "n_heads": c["num_attention_heads"],
        "n_kv_heads": c.get("num_key_value_heads") or c["num_attention_heads"],
        "norm": "rmsnorm",
        "norm_eps": c.get("rms_norm_eps", 1e-6),
        "mlp": "swiglu",
        "d_ff": c["intermediate_size"],
        "qkv_bias": family in ("qwen2", "qwen2_moe"),
        "qk_norm": family == "olmoe",
        "positions": "rope",
        "rope_base": _rope_base(c, problems),
        "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
        "layout": "dense",
    }
    if family == "mixtral":
        if c.get("num_experts_per_tok") == 1:
            problems.append(
                "num_experts_per_tok=1: Mixtral gives its one expert weight 1, mode's top-1 weight is the router "
                "probability (Switch)"
            )
        if c.get("router_jitter_noise"):
            problems.append("router_jitter_noise: set it to 0 (router noise in training is model.moe.jitter here)")
        model["layout"] = "moe"
        model["moe"] = {
            "n_experts": c["num_local_experts"],
            "top_k": c["num_experts_per_tok"],
            "d_ff": c["intermediate_size"],
            "mlp": "swiglu",
            "renormalize": True,
        }
    if family == "qwen2_moe":
        step = c.get("decoder_sparse_step", 1)
        dense_at = set(c.get("mlp_only_layers", []))
        model["qkv_bias"] = bool(c.get("qkv_bias", True))
        kinds = [
            "moe" if i not in dense_at and c["num_experts"] > 0 and (i + 1) % step == 0 else "dense"
            for i in range(c["num_hidden_layers"])
        ]
        model["layout"] = ",".join(kinds)
        shared = c.get("shared_expert_intermediate_size") or 0
        model["moe"] = _topk_prob_experts(c, c["moe_intermediate_size"], problems)
        model["moe"].update(shared_expert=bool(shared), shared_d_ff=shared, shared_gate=bool(shared))
    if family == "olmoe":
        if c.get("clip_qkv") is not None:
            problems.append(f"clip_qkv={c['clip_qkv']}: queries, keys and values are not clipped here")
        model["layout"] = "moe"
        model["moe"] = _topk_prob_experts(c, c["intermediate_size"], problems)
    return model


def _topk_prob_experts(c: dict, d_ff: int, problems: list[str]) -> dict:
    """``model.moe`` of an OLMoE / Qwen2-MoE config: SwiGLU experts ``d_ff`` wide whose top-k
    weights are renormalized when ``norm_topk_prob``."""
    topk = c["num_experts_per_tok"]
    if topk == 1 and c.get("norm_topk_prob"):
        problems.append("num_experts_per_tok=1 with norm_topk_prob: mode's top-1 weight is the router probability")
    renormalize = bool(c.get("norm_topk_prob", False))
    return {"n_experts": c["num_experts"], "top_k": topk, "d_ff": d_ff, "mlp": "swiglu", "renormalize": renormalize}


def _gpt2_config(c: dict, problems: list[str]) -> dict:
    act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}.get(c.get("activation_function"))
    if act is None:
        problems.append(f"activation_function={c.get('activation_function')!r}: gelu_new or gelu")
    for name in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if c.get(name):
            problems.append(f"{name}=true: attention here scales by 1/sqrt(head_dim) only")
    if c.get("scale_attn_weights") is False:
        problems.append("scale_attn_weights=false: attention here scales by 1/sqrt(head_dim)")
    d = c["n_embd"]
    return {
        "vocab_size": c["vocab_size"],
        "seq_len": c["n_positions"],
        "d_model": d,
        "n_layers": c["n_layer"],
        "n_heads": c["n_head"],
        "norm": "layernorm",
        "norm_eps": c.get("layer_norm_epsilon", 1e-5),
        "mlp": act or "gelu_tanh",
        "d_ff": c.get("n_inner") or 4 * d,
        "bias": True,
        "positions": "learned",
        "tie_embeddings": bool(c.get("tie_word_embeddings", True)),
        "layout": "dense",
    }


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
    _refuse(where, problems)


def state_from_hf(state: StateDict, cfg: ModelConfig, family: str) -> StateDict:
    """A Hugging Face state dict (of ``family``) as this library's parameter names and layouts."""
    tensors = _Tensors(state, "transformer." if family == "gpt2" else "model.")
    out = _gpt2_in(tensors, cfg) if family == "gpt2" else _llama_in(tensors, cfg)
    tensors.check_all_taken()
    return out


class _Tensors:
    """A checkpoint's tensors, taken one by one under their names inside the model's
    ``prefix`` (``model.`` / ``transformer.``; the head sits outside it); errors name the
    checkpoint's own keys."""

    IGNORED = ("attn.bias", "attn.masked_bias", "rotary_emb.inv_freq")  # buffers, not weights

    def __init__(self, state: StateDict, prefix: str) -> None:
        self.state, self.prefix = dict(state), prefix

    def _key(self, name: str) -> str:
        inside = self.prefix + name
        return inside if inside in self.state or name not in self.state else name

    def take(self, name: str) -> torch.Tensor:
        key = self._key(name)
        if key not in self.state:
            raise UnsupportedCheckpoint(f"the checkpoint has no tensor {self.prefix + name!r}")
        return self.state.pop(key)

    def take_optional(self, name: str) -> torch.Tensor | None:
        return self.state.pop(self._key(name), None)

    def has(self, name: str) -> bool:
        return self._key(name) in self.state

    def check_all_taken(self) -> None:
        rest = sorted(k for k in self.state if not k.endswith(self.IGNORED))
        _refuse("the checkpoint", [f"checkpoint tensors with no place here: {rest}"] if rest else [])


def _llama_in(state: _Tensors, cfg: ModelConfig) -> StateDict:
    out = {"tok_emb.weight": state.take("embed_tokens.weight"), "norm.weight": state.take("norm.weight")}
    head = state.take_optional("lm_head.weight")
    if not cfg.tie_embeddings:
        if head is None:
            raise UnsupportedCheckpoint("tie_word_embeddings=false but the checkpoint has no lm_head.weight")
        out["lm_head.weight"] = head
    for i, kind in enumerate(cfg.block_kinds()):
        p, q = f"layers.{i}.", f"blocks.{i}."
        out[q + "norm1.weight"] = state.take(p + "input_layernorm.weight")
        out[q + "norm2.weight"] = state.take(p + "post_attention_layernorm.weight")
        a = p + "self_attn."
        out[q + "attn.qkv.weight"] = torch.cat([state.take(a + f"{n}_proj.weight") for n in "qkv"])
        if cfg.qkv_bias:
            out[q + "attn.qkv.bias"] = torch.cat([state.take(a + f"{n}_proj.bias") for n in "qkv"])
        out[q + "attn.proj.weight"] = state.take(a + "o_proj.weight")
        if cfg.qk_norm:
            out[q + "attn.q_norm.weight"] = state.take(a + "q_norm.weight")
            out[q + "attn.k_norm.weight"] = state.take(a + "k_norm.weight")
        if kind == "moe":
            out.update(_experts_in(state, p, q + "mlp.", cfg.moe.n_experts))
            if cfg.moe.shared_expert:  # Qwen2-MoE's gated shared expert
                for theirs, ours in EXPERT_MLP:
                    w = state.take(p + f"mlp.shared_expert.{theirs}_proj.weight")
                    out[q + f"mlp.shared.{ours}"] = w.t().contiguous()[None]
                out[q + "mlp.shared_gate.weight"] = state.take(p + "mlp.shared_expert_gate.weight")
        else:
            for theirs, ours in DENSE_MLP:
                out[q + f"mlp.{ours}.weight"] = state.take(p + f"mlp.{theirs}_proj.weight")
    return out


def _experts_in(state: _Tensors, p: str, q: str, n_experts: int) -> StateDict:
    """Mixtral or OLMoE experts -> ``router.weight`` [E, D] and ``experts.w1/w3`` [E, D, F],
    ``w2`` [E, F, D]."""
    if state.has(p + "mlp.experts.gate_up_proj"):  # transformers 5's fused layout
        router = state.take(p + "mlp.gate.weight")
        gate, up = state.take(p + "mlp.experts.gate_up_proj").chunk(2, dim=1)  # [E, F, D] each
        down = state.take(p + "mlp.experts.down_proj")  # [E, D, F]
    elif state.has(p + "mlp.gate.weight"):  # OLMoE's and Qwen2-MoE's per-expert layout
        router = state.take(p + "mlp.gate.weight")
        gate, up, down = (
            torch.stack([state.take(p + f"mlp.experts.{e}.{w}_proj.weight") for e in range(n_experts)])
            for w, _ in EXPERT_MLP
        )
    else:
        m = p + "block_sparse_moe."
        router = state.take(m + "gate.weight")
        gate, down, up = (
            torch.stack([state.take(m + f"experts.{e}.{w}.weight") for e in range(n_experts)])
            for w in ("w1", "w2", "w3")
        )
    return {
        q + "router.weight": router,
        q + "experts.w1": gate.transpose(1, 2).contiguous(),
        q + "experts.w3": up.transpose(1, 2).contiguous(),
        q + "experts.w2": down.transpose(1, 2).contiguous(),
    }


def _gpt2_in(state: _Tensors, cfg: ModelConfig) -> StateDict:
    out = {
        "tok_emb.weight": state.take("wte.weight"),
        "pos_emb.weight": state.take("wpe.weight"),
        "norm.weight": state.take("ln_f.weight"),
        "norm.bias": state.take("ln_f.bias"),
    }
    head = state.take_optional("lm_head.weight")
    if not cfg.tie_embeddings and head is not None:
        out["lm_head.weight"] = head
    for i in range(cfg.n_layers):
        for ours, theirs, transposed in GPT2_BLOCK:
            w = state.take(f"h.{i}.{theirs}.weight")
            out[f"blocks.{i}.{ours}.weight"] = w.t().contiguous() if transposed else w
            out[f"blocks.{i}.{ours}.bias"] = state.take(f"h.{i}.{theirs}.bias")
    return out


# --- writing ----------------------------------------------------------------------------------


def hf_family(cfg: ModelConfig) -> str:
    """The Hugging Face family a model config exports to; ``UnsupportedCheckpoint`` naming
    every field that keeps it from one."""
    kinds = set(cfg.block_kinds())
    m = cfg.moe
    qwen_moe = "moe" in kinds and kinds <= {"dense", "moe"} and m.shared_gate  # dense layers: mlp_only_layers
    problems = []
    if kinds - {"dense", "moe"} or (len(kinds) > 1 and not qwen_moe):
        problems.append(
            f"model.layout={cfg.layout!r}: transformers has no depth-routed (MoD/MoDE) or mixed-layout model "
            "(but Qwen2-MoE's, whose MoE has a gated shared expert); export supports layout 'dense' or 'moe'"
        )
    gpt2 = (cfg.norm, cfg.mlp, cfg.bias, cfg.positions) == ("layernorm", "gelu_tanh", True, "learned")
    llama = (cfg.norm, cfg.mlp, cfg.bias, cfg.positions) == ("rmsnorm", "swiglu", False, "rope")
    if not (gpt2 or llama):
        problems.append(
            f"architecture norm={cfg.norm}, mlp={cfg.mlp}, bias={cfg.bias}, positions={cfg.positions}: export needs "
            "GPT-2's (layernorm, gelu_tanh, bias=true, learned) or Llama's (rmsnorm, swiglu, bias=false, rope)"
        )
    if gpt2 and (cfg.n_kv_heads not in (0, cfg.n_heads) or not cfg.tie_embeddings):
        problems.append("GPT-2 has one key/value head per query head and a tied head")
    if cfg.early_exit.enabled:
        problems.append("model.early_exit.enabled=true: an exited token skips later blocks that transformers runs")
    if cfg.qk_norm and "moe" not in kinds:
        problems.append("model.qk_norm=true: of the families only OLMoE (an MoE) normalizes queries and keys")
    if "moe" in kinds:
        family = "olmoe" if cfg.qk_norm else ("qwen2_moe" if m.shared_gate else "mixtral")
        name = {"olmoe": "OLMoE", "qwen2_moe": "Qwen2-MoE", "mixtral": "Mixtral"}[family]
        if not llama:
            problems.append(f"an MoE model exports as {name}, whose blocks are Llama's")
        if cfg.qkv_bias and family != "qwen2_moe":
            problems.append(f"model.qkv_bias=true: {name} has no attention biases")
        wanted = [("router", m.router, "token_choice"), ("mlp", m.mlp, "swiglu"), ("n_noop", m.n_noop, 0)]
        wanted.append(("shared_expert", m.shared_expert, family == "qwen2_moe"))
        if family == "mixtral":  # the others' norm_topk_prob says either
            wanted.append(("renormalize", m.renormalize, True))
        if family == "qwen2_moe" and cfg.qk_norm:
            wanted.append(("qk_norm", True, False))
        for field, value, want in wanted:
            if value != want:
                problems.append(f"model.moe.{field}={value!r}: {name} needs {want!r}")
        if m.top_k == 1 and family == "mixtral":
            problems.append("model.moe.top_k=1: Mixtral weighs one expert by 1, mode by its router probability")
    _refuse(f"model (layout {cfg.layout!r})", problems)
    if "moe" in kinds:
        return family
    return "gpt2" if gpt2 else ("qwen2" if cfg.qkv_bias else "llama")


def _native_family(model: MoDETransformer) -> str:
    """``hf_family`` of the model, also refusing a non-zero aux-loss-free selection bias."""
    family = hf_family(model.cfg)
    biases = [m.selection_bias for m in model.modules() if hasattr(m, "selection_bias")]
    if family in MOE_FAMILIES and any(b.any() for b in biases):
        _refuse("model", [f"the MoE selection bias (model.moe.bias_rate) is not zero: {family}'s router has none"])
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
        theirs = _gpt2_out(state, cfg) if family == "gpt2" else _llama_out(state, cfg, family)
        config = _config_out(cfg, family, next(iter(theirs.values())).dtype)
    tok = checked_tokenizer(tokenizer, cfg.vocab_size) if tokenizer is not None else None  # before any write
    path.mkdir(parents=True, exist_ok=True)
    _remove_stale_export(path)
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


def _config_out(cfg: ModelConfig, family: str, dtype: torch.dtype) -> dict:
    common = {"model_type": family, "vocab_size": cfg.vocab_size, "torch_dtype": str(dtype).removeprefix("torch.")}
    common["tie_word_embeddings"] = cfg.tie_embeddings
    if family == "gpt2":
        return {
            **common,
            "architectures": [ARCHITECTURES[family]],
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_positions": cfg.seq_len,
            "n_ctx": cfg.seq_len,
            "n_inner": cfg.dense_d_ff(),
            "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        }
    out = {
        **common,
        "architectures": [ARCHITECTURES[family]],
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.expert_d_ff() if family in ("mixtral", "olmoe") else cfg.dense_d_ff(),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.arch().kv_heads(cfg.n_heads),
        "head_dim": cfg.d_model // cfg.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "attention_dropout": 0.0,
    }
    if family == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if family in ("qwen2", "mixtral"):
        out.update(sliding_window=None, use_sliding_window=False)
    if family == "mixtral":
        out.update(
            num_local_experts=cfg.moe.n_experts,
            num_experts_per_tok=cfg.moe.top_k,
            router_jitter_noise=0.0,
            output_router_logits=False,
        )
    if family == "qwen2_moe":
        out.update(
            num_experts=cfg.moe.n_experts,
            num_experts_per_tok=cfg.moe.top_k,
            norm_topk_prob=cfg.moe.renormalize and cfg.moe.top_k > 1,
            moe_intermediate_size=cfg.expert_d_ff(),
            shared_expert_intermediate_size=cfg.moe.shared_d_ff or cfg.expert_d_ff(),
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, kind in enumerate(cfg.block_kinds()) if kind == "dense"],
            qkv_bias=cfg.qkv_bias,
            sliding_window=None,
            use_sliding_window=False,
            output_router_logits=False,
        )
    if family == "olmoe":
        out.update(
            num_experts=cfg.moe.n_experts,
            num_experts_per_tok=cfg.moe.top_k,
            norm_topk_prob=cfg.moe.renormalize and cfg.moe.top_k > 1,  # mode's top-1 weight is the probability
            clip_qkv=None,
            attention_bias=False,
            output_router_logits=False,
        )
    return out


def _llama_out(state: StateDict, cfg: ModelConfig, family: str) -> StateDict:
    Dh = cfg.d_model // cfg.n_heads
    kv_rows = cfg.arch().kv_heads(cfg.n_heads) * Dh
    qkv_rows = (cfg.n_heads * Dh, kv_rows, kv_rows)
    out = {"model.embed_tokens.weight": state["tok_emb.weight"], "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i, kind in enumerate(cfg.block_kinds()):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        out[p + "input_layernorm.weight"] = state[q + "norm1.weight"]
        out[p + "post_attention_layernorm.weight"] = state[q + "norm2.weight"]
        for part in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            for n, t in zip("qkv", state[q + f"attn.qkv.{part}"].split(qkv_rows), strict=True):
                out[p + f"self_attn.{n}_proj.{part}"] = t
        out[p + "self_attn.o_proj.weight"] = state[q + "attn.proj.weight"]
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = state[q + "attn.q_norm.weight"]
            out[p + "self_attn.k_norm.weight"] = state[q + "attn.k_norm.weight"]
        if family in ("olmoe", "qwen2_moe") and kind == "moe":
            out[p + "mlp.gate.weight"] = state[q + "mlp.router.weight"]
            for w, ours in EXPERT_MLP:
                for e, t in enumerate(state[q + f"mlp.experts.{ours}"]):
                    out[p + f"mlp.experts.{e}.{w}_proj.weight"] = t.t()
                if cfg.moe.shared_expert:
                    out[p + f"mlp.shared_expert.{w}_proj.weight"] = state[q + f"mlp.shared.{ours}"][0].t()
            if cfg.moe.shared_gate:
                out[p + "mlp.shared_expert_gate.weight"] = state[q + "mlp.shared_gate.weight"]
        elif family == "mixtral":
            m = p + "block_sparse_moe."
            out[m + "gate.weight"] = state[q + "mlp.router.weight"]
            for w in ("w1", "w2", "w3"):
                for e, t in enumerate(state[q + f"mlp.experts.{w}"]):
                    out[m + f"experts.{e}.{w}.weight"] = t.t()
        else:
            for theirs, ours in DENSE_MLP:
                out[p + f"mlp.{theirs}_proj.weight"] = state[q + f"mlp.{ours}.weight"]
    return out


def _gpt2_out(state: StateDict, cfg: ModelConfig) -> StateDict:
    out = {
        "transformer.wte.weight": state["tok_emb.weight"],
        "transformer.wpe.weight": state["pos_emb.weight"],
        "transformer.ln_f.weight": state["norm.weight"],
        "transformer.ln_f.bias": state["norm.bias"],
    }
    for i in range(cfg.n_layers):
        for ours, theirs, transposed in GPT2_BLOCK:
            w = state[f"blocks.{i}.{ours}.weight"]
            out[f"transformer.h.{i}.{theirs}.weight"] = w.t() if transposed else w
            out[f"transformer.h.{i}.{theirs}.bias"] = state[f"blocks.{i}.{ours}.bias"]
    return out


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
