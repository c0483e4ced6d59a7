"""The architecture choices every block shares: norm, MLP, attention heads, biases, positions.

With the defaults a block is this library's own (bias-free LayerNorm, GELU MLP, full
multi-head attention with RoPE); the options make a dense block exactly a published one:

============  =========  =========  ==========  ======  =========  =========
family        norm       mlp        n_kv_heads  bias    qkv_bias   positions
============  =========  =========  ==========  ======  =========  =========
GPT-2         layernorm  gelu_tanh  n_heads     true    (true)     learned
Llama         rmsnorm    swiglu     any         false   false      rope
Qwen2         rmsnorm    swiglu     any         false   true       rope
OLMoE         rmsnorm    swiglu     any         false   false      rope, qk_norm
============  =========  =========  ==========  ======  =========  =========

``qk_norm`` RMS-normalizes the projected queries (all heads at once, width D) and keys
(width Hkv * Dh) before RoPE (OLMoE).

``bias`` puts a bias on every linear of the block and on the norms (GPT-2); ``qkv_bias`` on
the query/key/value projection only (Qwen2). ``positions="learned"`` adds a position
embedding to the token embedding (the model owns it) and the blocks rotate nothing.
Experts (MoE) keep their own ``moe.mlp`` and have no biases.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass
from typing import Literal, get_args

import torch
from torch import nn

from mode.checks import check_choice, check_positive, fail

NormKind = Literal["layernorm", "rmsnorm"]
NORM_KINDS: tuple[str, ...] = get_args(NormKind)
DenseMlpKind = Literal["gelu", "gelu_tanh", "swiglu"]
DENSE_MLP_KINDS: tuple[str, ...] = get_args(DenseMlpKind)
PositionKind = Literal["rope", "learned"]
POSITION_KINDS: tuple[str, ...] = get_args(PositionKind)


@dataclass(frozen=True)
class Arch:
    """norm: "layernorm" | "rmsnorm" (``norm_eps``); mlp: the dense MLP, "gelu", "gelu_tanh"
    (GPT-2's tanh approximation) or "swiglu"; n_kv_heads: key/value heads (grouped-query
    attention; None = n_heads); bias / qkv_bias: see the module docstring; positions: "rope"
    (at ``rope_base``) or "learned"; qk_norm: RMSNorm on the projected queries and keys.

    The one validator of these options: ``ModelConfig`` builds its ``Arch`` (``field_prefix``
    "model.", not a field, is how errors name them) instead of checking them again."""

    norm: str = "layernorm"
    norm_eps: float = 1e-5
    mlp: str = "gelu"
    n_kv_heads: int | None = None
    bias: bool = False
    qkv_bias: bool = False
    positions: str = "rope"
    rope_base: float = 10000.0
    qk_norm: bool = False
    field_prefix: InitVar[str] = ""

    def __post_init__(self, field_prefix: str) -> None:
        check_choice(field_prefix + "norm", self.norm, NORM_KINDS)
        check_choice(field_prefix + "mlp", self.mlp, DENSE_MLP_KINDS)
        check_choice(field_prefix + "positions", self.positions, POSITION_KINDS)
        check_positive(field_prefix + "norm_eps", self.norm_eps)
        check_positive(field_prefix + "rope_base", self.rope_base)
        if self.n_kv_heads is not None:
            check_positive(field_prefix + "n_kv_heads", self.n_kv_heads)

    @property
    def rope(self) -> bool:
        return self.positions == "rope"

    def kv_heads(self, n_heads: int, field_prefix: str = "") -> int:
        """Key/value heads for ``n_heads`` query heads (the one place None means ``n_heads``);
        ``ValueError`` unless they divide them."""
        n_kv = self.n_kv_heads or n_heads
        if n_heads % n_kv:
            fail(
                field_prefix + "n_kv_heads", n_kv, f"must divide n_heads={n_heads} (each key/value head serves a group)"
            )
        return n_kv


DEFAULT_ARCH = Arch()


def make_norm(d_model: int, arch: Arch = DEFAULT_ARCH) -> nn.Module:
    """The block's norm over the last dim of x: [..., D]."""
    if arch.norm == "rmsnorm":
        return RMSNorm(d_model, arch.norm_eps)
    return nn.LayerNorm(d_model, eps=arch.norm_eps, bias=arch.bias)


class RMSNorm(nn.Module):
    """x: [..., D] -> x / rms(x) * weight, computed in float32 and cast back (as Llama's)."""

    keeps_float32 = True  # a norm's weight stays float32 under bf16 (mode.routed.keeps_float32)

    def __init__(self, d_model: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.normalized_shape = (d_model,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]}, eps={self.eps}"
