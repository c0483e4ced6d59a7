"""Analytic FLOPs (2 per multiply-add, matmuls only, as ``FlopCounterMode`` counts) and
parameter counts.

Each block kind's forward FLOPs live in the table of block kinds (``mode.layers.kinds``),
composed from the formulas beside the modules that compute them (``attention_flops``,
``mlp_flops``, ``moe_flops``). Counts are per sequence of T tokens. Attention over the n
tokens a block attends costs 4 n^2 D for scores and values (n = k for a MoD block: k^2, not
T^2), the full score matrix as ``FlopCounterMode`` counts it; ``masked=False`` counts only
the n(n+1)/2 query-key pairs that causal attention keeps. MoE layers count only computed
assignments (dropless) or their padded buffers (capacity MoE). A training step costs about
3x the forward (backward = 2x forward).
"""

from __future__ import annotations

from torch import nn

from mode.config import Config, ModelConfig
from mode.experts.mlp import mlp_flops
from mode.experts.moe import moe_flops
from mode.layers.attention import attention_flops
from mode.layers.kinds import block_kind
from mode.model import MoDETransformer
from mode.protocols import ActiveShare

__all__ = [
    "active_params",
    "attention_flops",
    "block_flops",
    "mlp_flops",
    "model_flops",
    "moe_flops",
    "print_flops",
    "train_flops_per_step",
]


def block_flops(kind: str, cfg: ModelConfig, seq_len: int | None = None, masked: bool = True) -> int:
    """Forward FLOPs of one block of ``kind`` on one sequence (``masked``: see ``attention_flops``)."""
    return block_kind(kind).flops(cfg, seq_len or cfg.seq_len, masked)


def model_flops(cfg: ModelConfig, seq_len: int | None = None) -> int:
    """Forward FLOPs of the whole LM on one sequence (blocks + LM head; embedding is a lookup).
    With early exit: the training forward (every block, every exit head on every token); in
    evaluation exits save a data-dependent share, reported as the ``compute_share`` metric."""
    T = seq_len or cfg.seq_len
    head = 2 * T * cfg.d_model * cfg.vocab_size
    if cfg.early_exit.enabled:  # training runs every exit head (min_layer .. n_layers - 1) on every token
        head *= 1 + cfg.n_layers - cfg.early_exit.min_layer
    return sum(block_flops(kind, cfg, T) for kind in cfg.block_kinds()) + head


def train_flops_per_step(cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> int:
    """Forward + backward FLOPs of one optimizer step (3x forward)."""
    return 3 * batch_size * model_flops(cfg, seq_len)


def active_params(model: nn.Module) -> int:
    """Parameters a token touches on average: expert weights count ``active_share()`` of their
    size (top_k / E, less the no-op share); tied weights count once."""
    total, seen = 0, set()
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        n = sum(p.numel() for p in own)
        total += round(n * module.active_share()) if isinstance(module, ActiveShare) else n
    return total


def print_flops(cfgs: list[Config]) -> None:
    """Parameters, active parameters and FLOPs per token of each config's model, as a table."""
    print(f"{'variant':<18}{'params':>13}{'active params':>15}{'fwd FLOPs/token':>17}{'train GFLOP/step':>18}")
    for cfg in cfgs:
        model = MoDETransformer(cfg.model)
        per_token = model_flops(cfg.model) / cfg.model.seq_len
        per_step = train_flops_per_step(cfg.model, cfg.train.batch_size) / 1e9
        print(f"{cfg.name:<18}{model.num_params():>13,}{active_params(model):>15,}{per_token:>17,.0f}{per_step:>18.1f}")
