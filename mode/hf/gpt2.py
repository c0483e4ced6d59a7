"""GPT-2 (``model_type`` "gpt2"): biased LayerNorm and linears, tanh-GELU MLP, learned
positions, tied head; its ``Conv1D`` weights are stored transposed ([in, out])."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mode.config import ModelConfig
from mode.hf.family import common_config_out
from mode.hf.files import StateDict, Tensors

# (ours, theirs, transposed: Conv1D stores [in, out]), each with a bias
GPT2_BLOCK = (
    ("norm1", "ln_1", False),
    ("attn.qkv", "attn.c_attn", True),
    ("attn.proj", "attn.c_proj", True),
    ("norm2", "ln_2", False),
    ("mlp.fc", "mlp.c_fc", True),
    ("mlp.proj", "mlp.c_proj", True),
)
GPT2_ARCH = ("layernorm", "gelu_tanh", True, "learned")  # (norm, mlp, bias, positions)


def is_gpt2_arch(cfg: ModelConfig) -> bool:
    return (cfg.norm, cfg.mlp, cfg.bias, cfg.positions) == GPT2_ARCH


@dataclass(frozen=True)
class GPT2:
    name: str = "gpt2"
    architecture: str | None = "GPT2LMHeadModel"
    prefix: str = "transformer."
    sizes: tuple[str, ...] = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
    moe: bool = False
    mixed_layouts: bool = False

    def config_in(self, c: dict, problems: list[str]) -> dict:
        acts = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
        act = acts.get(c.get("activation_function"))
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

    def state_in(self, state: Tensors, cfg: ModelConfig) -> StateDict:
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

    def holds(self, cfg: ModelConfig) -> bool:
        return "moe" not in cfg.block_kinds() and is_gpt2_arch(cfg)

    def export_problems(self, cfg: ModelConfig) -> list[str]:
        if cfg.n_kv_heads not in (0, cfg.n_heads) or not cfg.tie_embeddings:
            return ["GPT-2 has one key/value head per query head and a tied head"]
        return []

    def config_out(self, cfg: ModelConfig, dtype: torch.dtype) -> dict:
        return {
            **common_config_out(cfg, self, dtype),
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

    def state_out(self, state: StateDict, cfg: ModelConfig) -> StateDict:
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
