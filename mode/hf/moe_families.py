"""The MoE families, Llama blocks with an MoE MLP (``mode.hf.llama.Llama`` with its MoE hooks):

- ``mixtral`` -> a ``moe`` layout: a softmax router over ``num_local_experts``, top
  ``num_experts_per_tok`` renormalized, SwiGLU experts (the per-expert ``w1/w2/w3`` layout
  and transformers 5's fused ``gate_up_proj``/``down_proj`` both read). ``moe`` models with
  no family of their own are written as Mixtral, in the per-expert layout every transformers
  version loads.
- ``olmoe`` -> a ``moe`` layout with query/key norms (``model.qk_norm``): a softmax router
  over ``num_experts``, top ``num_experts_per_tok`` renormalized when ``norm_topk_prob``.
- ``qwen2_moe`` -> Qwen2 attention, ``moe`` blocks with a gated shared expert
  (``moe.shared_d_ff``, ``moe.shared_gate``) and ``dense`` blocks at ``mlp_only_layers`` and
  between the ``decoder_sparse_step`` ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mode.config import ModelConfig
from mode.hf.files import StateDict, Tensors
from mode.hf.llama import LLAMA_SIZES, Llama, is_llama_arch

# Llama-family ``{name}_proj`` of a SwiGLU expert -> this library's ``experts.<ours>`` (transposed)
EXPERT_MLP = (("gate", "w1"), ("up", "w3"), ("down", "w2"))


def experts_in(state: Tensors, p: str, q: str, n_experts: int) -> StateDict:
    """Mixtral, OLMoE or Qwen2-MoE experts of layer ``p`` -> ``q`` + ``router.weight`` [E, D]
    and ``experts.w1/w3`` [E, D, F], ``w2`` [E, F, D]."""
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


def topk_prob_experts(c: dict, d_ff: int, problems: list[str]) -> dict:
    """``model.moe`` of an OLMoE / Qwen2-MoE config: SwiGLU experts ``d_ff`` wide whose top-k
    weights are renormalized when ``norm_topk_prob``."""
    topk = c["num_experts_per_tok"]
    if topk == 1 and c.get("norm_topk_prob"):
        problems.append("num_experts_per_tok=1 with norm_topk_prob: mode's top-1 weight is the router probability")
    renormalize = bool(c.get("norm_topk_prob", False))
    return {"n_experts": c["num_experts"], "top_k": topk, "d_ff": d_ff, "mlp": "swiglu", "renormalize": renormalize}


@dataclass(frozen=True)
class LlamaMoE(Llama):
    """An MoE family: ``title`` names it in messages; ``shared``: its MoE has a gated shared
    expert (Qwen2-MoE), and so its layouts may mix dense and MoE blocks."""

    title: str = ""
    shared: bool = False
    moe: bool = True

    def holds(self, cfg: ModelConfig) -> bool:
        return "moe" in cfg.block_kinds() and self.claims(cfg)

    def claims(self, cfg: ModelConfig) -> bool:
        """Whether an MoE config is this family's (the registry asks them in order)."""
        return True

    def export_problems(self, cfg: ModelConfig) -> list[str]:
        m, problems = cfg.moe, []
        if not is_llama_arch(cfg):
            problems.append(f"an MoE model exports as {self.title}, whose blocks are Llama's")
        if cfg.qkv_bias and not self.qkv_bias:
            problems.append(f"model.qkv_bias=true: {self.title} has no attention biases")
        wanted = [("router", m.router, "token_choice"), ("mlp", m.mlp, "swiglu"), ("n_noop", m.n_noop, 0)]
        wanted += [("shared_expert", m.shared_expert, self.shared), *self.wanted(cfg)]
        for name, value, want in wanted:
            if value != want:
                problems.append(f"model.moe.{name}={value!r}: {self.title} needs {want!r}")
        return problems

    def wanted(self, cfg: ModelConfig) -> list[tuple[str, object, object]]:
        """The family's own ``(model.moe field, value, the value it needs)``."""
        return []

    def state_out_moe(self, state: StateDict, p: str, q: str, cfg: ModelConfig) -> StateDict:
        """OLMoE's and Qwen2-MoE's per-expert layout (``mlp.gate``, ``mlp.experts.<e>.<w>_proj``)."""
        out = {p + "mlp.gate.weight": state[q + "router.weight"]}
        for w, ours in EXPERT_MLP:
            for e, t in enumerate(state[q + f"experts.{ours}"]):
                out[p + f"mlp.experts.{e}.{w}_proj.weight"] = t.t()
            if cfg.moe.shared_expert:
                out[p + f"mlp.shared_expert.{w}_proj.weight"] = state[q + f"shared.{ours}"][0].t()
        if cfg.moe.shared_gate:
            out[p + "mlp.shared_expert_gate.weight"] = state[q + "shared_gate.weight"]
        return out

    def state_in_moe(self, state: Tensors, p: str, q: str, cfg: ModelConfig) -> StateDict:
        out = experts_in(state, p, q, cfg.moe.n_experts)
        if cfg.moe.shared_expert:  # Qwen2-MoE's gated shared expert
            for theirs, ours in EXPERT_MLP:
                w = state.take(p + f"mlp.shared_expert.{theirs}_proj.weight")
                out[q + f"shared.{ours}"] = w.t().contiguous()[None]
            out[q + "shared_gate.weight"] = state.take(p + "mlp.shared_expert_gate.weight")
        return out

    def intermediate_size(self, cfg: ModelConfig) -> int:
        return cfg.expert_d_ff()


@dataclass(frozen=True)
class Mixtral(LlamaMoE):
    name: str = "mixtral"
    architecture: str | None = "MixtralForCausalLM"
    title: str = "Mixtral"
    extra_out: dict = field(default_factory=lambda: {"sliding_window": None, "use_sliding_window": False})

    @property
    def sizes(self) -> tuple[str, ...]:
        return (*LLAMA_SIZES, "num_local_experts", "num_experts_per_tok")

    def config_in_moe(self, c: dict, problems: list[str]) -> dict:
        if c.get("num_experts_per_tok") == 1:
            problems.append(
                "num_experts_per_tok=1: Mixtral gives its one expert weight 1, mode's top-1 weight is the router "
                "probability (Switch)"
            )
        if c.get("router_jitter_noise"):
            problems.append("router_jitter_noise: set it to 0 (router noise in training is model.moe.jitter here)")
        experts = {"n_experts": c["num_local_experts"], "top_k": c["num_experts_per_tok"]}
        return {
            "layout": "moe",
            "moe": experts | {"d_ff": c["intermediate_size"], "mlp": "swiglu", "renormalize": True},
        }

    def wanted(self, cfg: ModelConfig) -> list[tuple[str, object, object]]:
        return [("renormalize", cfg.moe.renormalize, True)]  # the others' norm_topk_prob says either

    def export_problems(self, cfg: ModelConfig) -> list[str]:
        problems = super().export_problems(cfg)
        if cfg.moe.top_k == 1:
            problems.append("model.moe.top_k=1: Mixtral weighs one expert by 1, mode by its router probability")
        return problems

    def config_out_moe(self, cfg: ModelConfig) -> dict:
        return {
            "num_local_experts": cfg.moe.n_experts,
            "num_experts_per_tok": cfg.moe.top_k,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
        }

    def state_out_moe(self, state: StateDict, p: str, q: str, cfg: ModelConfig) -> StateDict:
        m = p + "block_sparse_moe."
        out = {m + "gate.weight": state[q + "router.weight"]}
        for w in ("w1", "w2", "w3"):
            for e, t in enumerate(state[q + f"experts.{w}"]):
                out[m + f"experts.{e}.{w}.weight"] = t.t()
        return out


@dataclass(frozen=True)
class OLMoE(LlamaMoE):
    name: str = "olmoe"
    architecture: str | None = "OlmoeForCausalLM"
    title: str = "OLMoE"
    qk_norm: bool = True
    extra_out: dict = field(default_factory=lambda: {"clip_qkv": None, "attention_bias": False})

    @property
    def sizes(self) -> tuple[str, ...]:
        return (*LLAMA_SIZES, "num_experts", "num_experts_per_tok")

    def claims(self, cfg: ModelConfig) -> bool:
        return cfg.qk_norm

    def config_in_moe(self, c: dict, problems: list[str]) -> dict:
        if c.get("clip_qkv") is not None:
            problems.append(f"clip_qkv={c['clip_qkv']}: queries, keys and values are not clipped here")
        return {"layout": "moe", "moe": topk_prob_experts(c, c["intermediate_size"], problems)}

    def config_out_moe(self, cfg: ModelConfig) -> dict:
        return {
            "num_experts": cfg.moe.n_experts,
            "num_experts_per_tok": cfg.moe.top_k,
            "norm_topk_prob": cfg.moe.renormalize and cfg.moe.top_k > 1,  # mode's top-1 weight is the probability
            "output_router_logits": False,
        }


@dataclass(frozen=True)
class Qwen2MoE(LlamaMoE):
    name: str = "qwen2_moe"
    architecture: str | None = "Qwen2MoeForCausalLM"
    title: str = "Qwen2-MoE"
    qkv_bias: bool = True
    shared: bool = True
    mixed_layouts: bool = True
    extra_out: dict = field(default_factory=dict)

    @property
    def sizes(self) -> tuple[str, ...]:
        return (*LLAMA_SIZES, "num_experts", "num_experts_per_tok", "moe_intermediate_size")

    def claims(self, cfg: ModelConfig) -> bool:
        return cfg.moe.shared_gate

    def config_in_moe(self, c: dict, problems: list[str]) -> dict:
        step = c.get("decoder_sparse_step", 1)
        dense_at = set(c.get("mlp_only_layers", []))
        kinds = [
            "moe" if i not in dense_at and c["num_experts"] > 0 and (i + 1) % step == 0 else "dense"
            for i in range(c["num_hidden_layers"])
        ]
        shared = c.get("shared_expert_intermediate_size") or 0
        moe = topk_prob_experts(c, c["moe_intermediate_size"], problems)
        moe.update(shared_expert=bool(shared), shared_d_ff=shared, shared_gate=bool(shared))
        return {"qkv_bias": bool(c.get("qkv_bias", True)), "layout": ",".join(kinds), "moe": moe}

    def intermediate_size(self, cfg: ModelConfig) -> int:
        return cfg.dense_d_ff()  # the dense blocks' MLP; the experts' is moe_intermediate_size

    def config_out_moe(self, cfg: ModelConfig) -> dict:
        return {
            "num_experts": cfg.moe.n_experts,
            "num_experts_per_tok": cfg.moe.top_k,
            "norm_topk_prob": cfg.moe.renormalize and cfg.moe.top_k > 1,
            "moe_intermediate_size": cfg.expert_d_ff(),
            "shared_expert_intermediate_size": cfg.moe.shared_d_ff or cfg.expert_d_ff(),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, kind in enumerate(cfg.block_kinds()) if kind == "dense"],
            "qkv_bias": cfg.qkv_bias,
            "sliding_window": None,
            "use_sliding_window": False,
            "output_router_logits": False,
        }


MIXTRAL, OLMOE, QWEN2_MOE = Mixtral(), OLMoE(), Qwen2MoE()
