"""Causal multi-head attention with RoPE at the tokens' original positions.

Legend: B batch, T tokens (possibly a routed subset), H heads, Dh head dim, D = H * Dh.
A routed block gathers its chosen tokens in position order and passes their original
positions, so RoPE and the causal mask are those of the full sequence restricted to the
chosen set.

Backends (``model.attention``): "sdpa" (``F.scaled_dot_product_attention``, any device, the
default) and "xformers" (``xformers.ops.memory_efficient_attention`` with a lower-triangular
bias over the packed chosen tokens, which is the causal mask by original position; CUDA only).
Decode steps (one query against the cache's mask) always use SDPA.
"""

from __future__ import annotations

import importlib.util
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

AttentionBackend = Literal["sdpa", "xformers"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)


def attention_unavailable_reason(backend: str, device: torch.device | str | None = None) -> str | None:
    """Why attention ``backend`` cannot run (on ``device``, when given), or None when it can."""
    if backend == "sdpa":
        return None
    if backend != "xformers":
        return f"unknown attention backend {backend!r}: choose one of {list(ATTENTION_BACKENDS)}"
    if importlib.util.find_spec("xformers") is None:
        return "xformers is not installed: pip install xformers (or the GPU extra: pip install 'mode-moe[gpu]')"
    if device is not None and torch.device(device).type != "cuda":
        return f"xformers memory-efficient attention runs on CUDA here, not {torch.device(device).type}"
    return None


def xformers_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q, k, v: [B, H, T, Dh] -> [B, H, T, Dh], causal in token order (xformers' layout is
    [B, T, H, Dh])."""
    import xformers.ops as xops  # noqa: PLC0415

    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    y = xops.memory_efficient_attention(q, k, v, attn_bias=xops.LowerTriangularMask())
    return y.transpose(1, 2)


def attention_flops(n: int, d: int, masked: bool = True) -> int:
    """Forward FLOPs (2 per multiply-add) of attention over n tokens: QKV + output projections
    (8 n D^2) and scores/values, 4 n^2 D with the causal mask's masked half counted
    (``masked=True``, as ``FlopCounterMode``), else 2 n (n+1) D (what a flash kernel computes)."""
    scores = 4 * n * n * d if masked else 2 * n * (n + 1) * d
    return 8 * n * d * d + scores


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [B, T] (or [T]) integer -> cos, sin: [B, 1, T, Dh/2] float32."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [B, T, Dh/2]
    if angles.dim() == 2:
        angles = angles.unsqueeze(0)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The RoPE rotation of x: [B, H, T, Dh] by angles with cos, sin: [B, 1, T, Dh/2]: each
    pair (x_i, x_{i + Dh/2}) turns by its angle (GPT-NeoX layout), computed in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class _Rope(torch.autograd.Function):
    """RoPE with a hand-written backward: the rotation is orthogonal, so the input gradient
    is the output gradient turned back (``rotate`` by -angle). Saves cos and sin only, where
    autograd through ``rotate`` would keep four half-size products and run twice the kernels."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return rotate(grad, cos, -sin), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, Dh] -> x with RoPE applied (``rotate``; cos, sin from ``rope_cos_sin``)."""
    return _Rope.apply(x, cos, sin)


class CausalSelfAttention(nn.Module):
    """x: [B, T, D] -> [B, T, D]; causal over the given token order (positions ascending)."""

    def __init__(self, d_model: int, n_heads: int, rope_base: float = 10000.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.rope_base = rope_base
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.backend: AttentionBackend = "sdpa"

    def set_backend(self, backend: str) -> None:
        """Use attention ``backend`` ("sdpa" or "xformers") from now on; RuntimeError saying what
        to install when it is not importable (the device is checked at forward)."""
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend={backend!r} is invalid: choose one of {list(ATTENTION_BACKENDS)}")
        reason = attention_unavailable_reason(backend)
        if reason is not None:
            raise RuntimeError(f"attention backend {backend!r} cannot be used: {reason}")
        self.backend = backend

    def project_qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [B, T, D], positions: [B, T] -> q, k, v: [B, H, T, Dh] with RoPE applied to q, k."""
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_base)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """y: [B, H, T, Dh] -> [B, T, D]."""
        B, H, T, Dh = y.shape
        return self.proj(y.transpose(1, 2).reshape(B, T, H * Dh))

    def attend(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, D] -> (out [B, T, D], k, v [B, H, T, Dh]), causal over the given order."""
        q, k, v = self.project_qkv(x, positions)
        # NOTE: positions are ascending within a row, so "causal in token order" is "causal by
        # original position" (a routed block passes its chosen tokens in position order).
        if self.backend == "xformers":
            reason = attention_unavailable_reason("xformers", x.device)
            if reason is not None:
                raise RuntimeError(f"attention backend 'xformers' cannot run: {reason}")
            y = xformers_causal_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output(y), k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        return self.attend(x, positions)[0]

    def decode(self, x: torch.Tensor, positions: torch.Tensor, cache, rows: torch.Tensor) -> torch.Tensor:
        """One new token per row: x [b, 1, D] at ``positions`` [b] for cache rows ``rows`` [b].
        Appends its key/value to the cache, then attends over the row's cached entries."""
        q, k, v = self.project_qkv(x, positions[:, None])
        cache.append(rows, k, v)
        keys, values, mask = cache.view(rows)
        return self.output(F.scaled_dot_product_attention(q, keys, values, attn_mask=mask))
