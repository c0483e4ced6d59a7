"""The Llama group (``llama``, ``mistral``, ``qwen2``): RMSNorm, SwiGLU, grouped-query
attention with RoPE (Qwen2 with query/key/value biases). Mistral's sliding window becomes the
model's ``seq_len`` (within the window, sliding-window attention is full causal attention);
Mistral is read, never written (its models export as Llama).

``Llama`` is also the base of the MoE families (``mode.hf.moe_families``), whose blocks are
Llama's with an MoE MLP: they override the ``*_moe`` hooks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mode.config import ModelConfig
from mode.hf.family import common_config_out
from mode.hf.files import StateDict, Tensors, UnsupportedCheckpoint

LLAMA_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
LLAMA_ARCH = ("rmsnorm", "swiglu", False, "rope")  # (norm, mlp, bias, positions)
# Llama-family ``{name}_proj`` of a SwiGLU MLP -> this library's dense MLP (``mlp.<ours>``)
DENSE_MLP = (("gate", "fc"), ("up", "up"), ("down", "proj"))


def is_llama_arch(cfg: ModelConfig) -> bool:
    return (cfg.norm, cfg.mlp, cfg.bias, cfg.positions) == LLAMA_ARCH


def rope_base(c: dict, problems: list[str]) -> float:
    params = c.get("rope_parameters") or {}  # transformers 5
    scaling = c.get("rope_scaling") or {}  # transformers 4
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        problems.append(f"rope type {kind!r} (RoPE scaling): only plain RoPE is implemented")
    return float(params.get("rope_theta", c.get("rope_theta", 10000.0)))


def check_heads(c: dict, problems: list[str]) -> None:
    d, h = c["hidden_size"], c["num_attention_heads"]
    if c.get("head_dim") not in (None, d // h):
        problems.append(f"head_dim={c['head_dim']}: heads here are hidden_size / num_attention_heads = {d // h}")
    kinds = set(c.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        problems.append(f"layer_types={sorted(kinds)}: every layer attends fully here")


@dataclass(frozen=True)
class Llama:
    """A Llama-style family. ``qkv_bias``: its attention has query/key/value biases (Qwen2);
    ``qk_norm``: it normalizes queries and keys (OLMoE); ``windowed``: its sliding window
    always applies (Mistral; others only with ``use_sliding_window``); ``extra_out``: the
    family's own constant ``config.json`` fields."""

    name: str = "llama"
    architecture: str | None = "LlamaForCausalLM"
    qkv_bias: bool = False
    qk_norm: bool = False
    windowed: bool = False
    extra_out: dict = field(default_factory=lambda: {"attention_bias": False, "mlp_bias": False})
    prefix: str = "model."
    moe: bool = False
    mixed_layouts: bool = False

    @property
    def sizes(self) -> tuple[str, ...]:
        return LLAMA_SIZES

    # -- reading -----------------------------------------------------------------------------
    def config_in(self, c: dict, problems: list[str]) -> dict:
        check_heads(c, problems)
        if c.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={c['hidden_act']!r}: the SwiGLU MLP here uses silu")
        for name in ("attention_bias", "mlp_bias"):
            if c.get(name):
                problems.append(f"{name}=true: a Llama-family model here has biases on q, k, v (Qwen2) or none")
        seq_len = c.get("max_position_embeddings", 2048)
        window = c.get("sliding_window")
        if window and (self.windowed or c.get("use_sliding_window")):
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
            "qkv_bias": self.qkv_bias,
            "qk_norm": self.qk_norm,
            "positions": "rope",
            "rope_base": rope_base(c, problems),
            "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
            "layout": "dense",
        }
        return model | self.config_in_moe(c, problems)

    def config_in_moe(self, c: dict, problems: list[str]) -> dict:
        """The MoE families' ``model`` fields (layout, ``moe``); none for a dense family."""
        return {}

    def state_in(self, state: Tensors, cfg: ModelConfig) -> StateDict:
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
                out.update(self.state_in_moe(state, p, q + "mlp.", cfg))
            else:
                for theirs, ours in DENSE_MLP:
                    out[q + f"mlp.{ours}.weight"] = state.take(p + f"mlp.{theirs}_proj.weight")
        return out

    def state_in_moe(self, state: Tensors, p: str, q: str, cfg: ModelConfig) -> StateDict:
        """Layer ``p``'s MoE MLP as ``q`` + this library's names (MoE families only)."""
        raise NotImplementedError(f"{self.name} has no MoE blocks")

    # -- writing -----------------------------------------------------------------------------
    def holds(self, cfg: ModelConfig) -> bool:
        return self.architecture is not None and "moe" not in cfg.block_kinds() and cfg.qkv_bias == self.qkv_bias

    def export_problems(self, cfg: ModelConfig) -> list[str]:
        return []

    def config_out(self, cfg: ModelConfig, dtype: torch.dtype) -> dict:
        return {
            **common_config_out(cfg, self, dtype),
            "hidden_size": cfg.d_model,
            "intermediate_size": self.intermediate_size(cfg),
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
            **self.extra_out,
            **self.config_out_moe(cfg),
        }

    def intermediate_size(self, cfg: ModelConfig) -> int:
        """``config.json``'s ``intermediate_size``: the dense MLP's width."""
        return cfg.dense_d_ff()

    def config_out_moe(self, cfg: ModelConfig) -> dict:
        """The MoE families' ``config.json`` fields of ``cfg``; none for a dense family."""
        return {}

    def state_out(self, state: StateDict, cfg: ModelConfig) -> StateDict:
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
            if kind == "moe":
                out.update(self.state_out_moe(state, p, q + "mlp.", cfg))
            else:
                for theirs, ours in DENSE_MLP:
                    out[p + f"mlp.{theirs}_proj.weight"] = state[q + f"mlp.{ours}.weight"]
        return out

    def state_out_moe(self, state: StateDict, p: str, q: str, cfg: ModelConfig) -> StateDict:
        """This library's MoE MLP ``q`` as layer ``p``'s tensors (MoE families only)."""
        raise NotImplementedError(f"{self.name} has no MoE blocks")


LLAMA = Llama()
MISTRAL = Llama(name="mistral", architecture=None, windowed=True, extra_out={})
QWEN2 = Llama(
    name="qwen2",
    architecture="Qwen2ForCausalLM",
    qkv_bias=True,
    extra_out={"sliding_window": None, "use_sliding_window": False},
)
