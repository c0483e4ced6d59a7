"""Analytic forward FLOPs (2 per multiply-add, matmuls only, as ``FlopCounterMode`` counts).

Counts per sequence of T tokens. Attention scores cost 2*n^2*D (QK^T) + 2*n^2*D (AV) over the
n tokens a block actually attends (n = k for a MoD block: k^2, not T^2), the full score matrix
as ``FlopCounterMode`` counts it; ``masked=False`` counts only the n(n+1)/2 query-key pairs that
causal attention keeps, which is closer to what a flash kernel computes. MoE layers count
only computed assignments (dropless) or their padded buffers (capacity MoE). A training
step costs about 3x the forward (backward = 2x forward).
"""

from __future__ import annotations

from mode.config import ModelConfig
from mode.routing.expert_choice import capacity_to_k
from mode.routing.token_choice import expert_capacity


def attention_flops(n: int, d: int, masked: bool = True) -> int:
    """QKV + output projections (8 n D^2) and scores/values over n tokens: 4 n^2 D with the
    causal mask's masked half counted (``masked=True``, as ``FlopCounterMode``), else 2 n (n+1) D."""
    scores = 4 * n * n * d if masked else 2 * n * (n + 1) * d
    return 8 * n * d * d + scores


def mlp_flops(n: int, d: int, d_ff: int, kind: str = "gelu") -> int:
    """A 2-layer MLP (4 n D F) or SwiGLU (6 n D F) on n tokens."""
    return (6 if kind == "swiglu" else 4) * n * d * d_ff


def moe_flops(n: int, cfg: ModelConfig, kind: str = "moe", real_share: float = 1.0, n_noop: int = 0) -> int:
    """Router over E (+ no-op) experts, plus expert GEMMs on n tokens.

    kind "moe": dropless, n*top_k*real_share assignments; "moe_capacity": E padded buffers.
    """
    m, d = cfg.moe, cfg.d_model
    f = cfg.expert_d_ff()
    router = 2 * n * d * (m.n_experts + n_noop)
    if kind == "moe_capacity":
        rows = m.n_experts * expert_capacity(n, m.top_k, m.n_experts, m.capacity_factor)
    else:
        rows = round(n * m.top_k * real_share)
    shared = mlp_flops(n, d, f, m.mlp) if m.shared_expert else 0
    return router + mlp_flops(rows, d, f, m.mlp) + shared


def block_flops(kind: str, cfg: ModelConfig, seq_len: int | None = None, masked: bool = True) -> int:
    """Forward FLOPs of one block of ``kind`` on one sequence (``masked``: see ``attention_flops``)."""
    T = seq_len or cfg.seq_len
    d = cfg.d_model
    if kind == "dense":
        return attention_flops(T, d, masked) + mlp_flops(T, d, cfg.mlp_ratio * d)
    if kind in ("mod", "mode_staged"):
        k = capacity_to_k(cfg.mod.capacity, T)
        router = 2 * T * d
        if cfg.mod.causal == "predictor":  # the routing predictor runs on every token
            router += 2 * T * cfg.mod.predictor_hidden * (d + 1)
        inner = mlp_flops(k, d, cfg.mlp_ratio * d) if kind == "mod" else moe_flops(k, cfg)
        return router + attention_flops(k, d, masked) + (inner if k else 0)
    if kind in ("moe", "moe_capacity"):
        return attention_flops(T, d, masked) + moe_flops(T, cfg, kind)
    if kind == "mode_integrated":
        m = cfg.moe
        # Expected share of assignments that reach a real expert: the balance loss targets
        # ``noop_share`` of assignments on the no-op experts.
        real_share = 1.0 - (m.noop_share if m.n_noop else 0.0)
        return attention_flops(T, d, masked) + moe_flops(T, cfg, "moe", real_share, m.n_noop)
    raise ValueError(f"unknown block kind {kind!r}")


def model_flops(cfg: ModelConfig, seq_len: int | None = None) -> int:
    """Forward FLOPs of the whole LM on one sequence (blocks + LM head; embedding is a lookup)."""
    T = seq_len or cfg.seq_len
    head = 2 * T * cfg.d_model * cfg.vocab_size
    return sum(block_flops(kind, cfg, T) for kind in cfg.block_kinds()) + head


def train_flops_per_step(cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> int:
    """Forward + backward FLOPs of one optimizer step (3x forward)."""
    return 3 * batch_size * model_flops(cfg, seq_len)
