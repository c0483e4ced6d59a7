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


def rope_rows(positions: torch.Tensor, head_dim: int, base: float) -> torch.Tensor:
    """positions: [...] integer -> [..., 2, Dh] float32 rows ``(C, S)`` with C = (cos, cos) and
    S = (-sin, sin) of each pair's angle, so that RoPE is ``x * C + swap_halves(x) * S``."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [..., Dh/2]
    cos, sin = angles.cos(), angles.sin()
    return torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=-2)


# (device, head_dim, base) -> [L, 2, Dh] rows of positions 0..L-1, grown on demand: computed
# once per process for every layer and step, not once per layer per forward; and the
# (C, S) views [T, 1, 1, Dh] of its first T rows, so a dense block's RoPE costs no table op.
_ROPE_TABLES: dict[tuple[str, int, float], torch.Tensor] = {}
_ROPE_PREFIXES: dict[tuple[str, int, float, int], tuple[torch.Tensor, torch.Tensor]] = {}


def rope_table(length: int, head_dim: int, base: float, device: torch.device) -> torch.Tensor:
    """[length, 2, Dh] ``rope_rows`` of positions 0..length-1 (a cached table's first rows).
    Under ``torch.compile`` computed in the graph (the compiler folds it), not cached."""
    if torch.compiler.is_compiling():
        return rope_rows(torch.arange(length, device=device), head_dim, base)
    key = (str(device), head_dim, float(base))
    table = _ROPE_TABLES.get(key)
    if table is None or table.shape[0] < length:
        size = max(length, 2 * table.shape[0] if table is not None else 256)
        # NOTE: made outside inference mode so that a table first built while sampling can
        # still be saved for backward by a later training step.
        with torch.inference_mode(False), torch.no_grad():
            table = rope_rows(torch.arange(size, device=device), head_dim, base)
        _ROPE_TABLES[key] = table
    return table[:length]


def rope_prefix(length: int, head_dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, S): [length, 1, 1, Dh] each, the RoPE factors of positions 0..length-1, shaped to
    broadcast over [B, T, n, H, Dh] (cached views of ``rope_table``)."""
    key = (str(device), head_dim, float(base), length)
    cached = None if torch.compiler.is_compiling() else _ROPE_PREFIXES.get(key)
    if cached is None:
        rows = rope_table(length, head_dim, base, device)[:, :, None, None, :]  # [T, 2, 1, 1, Dh]
        cached = rows[:, 0], rows[:, 1]
        if not torch.compiler.is_compiling():
            _ROPE_PREFIXES[key] = cached
    return cached


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (x2, x1) along the last dim (its own inverse and its own transpose)."""
    return x.roll(x.shape[-1] // 2, dims=-1)


class _Rope(torch.autograd.Function):
    """RoPE as ``y = x * C + swap_halves(x) * S`` in float32 (GPT-NeoX layout: each pair
    (x_i, x_{i + Dh/2}) turns by its angle), with a hand-written backward: the rotation is
    orthogonal, so ``dx = g * C + swap_halves(g * S)``. Saves only the table rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(c, s)
        xf = x.float()
        return (xf * c + swap_halves(xf) * s).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        c, s = ctx.saved_tensors
        g = grad.float()
        return (g * c + swap_halves(g * s)).to(grad.dtype), None, None


def apply_rope(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x rotated by RoPE: x [B, T, n, H, Dh] (q and k together: n = 2), c and s its factors
    broadcast to x (``rope_prefix``'s [T, 1, 1, Dh], or [B, T, 1, 1, Dh] gathered rows)."""
    return _Rope.apply(x, c, s)


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

    def rope(
        self, positions: torch.Tensor | None, T: int, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE factors (C, S) for T tokens at ``positions`` [B, T] (None: 0..T-1, [T, 1, 1, Dh]
        views of the cached table), else [B, T, 1, 1, Dh]. ``length`` bounds the positions
        (e.g. the full sequence a routed block gathered from): the rows are then one gather
        from the cached table; without it they are computed from the positions."""
        if positions is None:
            return rope_prefix(T, self.head_dim, self.rope_base, self.qkv.weight.device)
        if length is not None:
            rows = rope_table(length, self.head_dim, self.rope_base, positions.device)[positions]
        else:
            rows = rope_rows(positions, self.head_dim, self.rope_base)
        rows = rows[:, :, :, None, None, :]  # [B, T, 2, 1, 1, Dh]
        return rows[:, :, 0], rows[:, :, 1]

    def project_qkv(
        self, x: torch.Tensor, positions: torch.Tensor | None, length: int | None = None
    ) -> tuple[torch.Tensor, ...]:
        """x: [B, T, D], positions: [B, T] (None: 0..T-1; ``length`` as in ``rope``) -> q, k,
        v: [B, H, T, Dh] with RoPE applied to q and k (one rotation of both)."""
        B, T, D = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim)
        qk = apply_rope(qkv[:, :, :2], *self.rope(positions, T, length))
        q, k = qk.permute(2, 0, 3, 1, 4).unbind(0)
        return q, k, qkv[:, :, 2].transpose(1, 2)

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """y: [B, H, T, Dh] -> [B, T, D]."""
        B, H, T, Dh = y.shape
        return self.proj(y.transpose(1, 2).reshape(B, T, H * Dh))

    def attend(
        self, x: torch.Tensor, positions: torch.Tensor | None, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, D] -> (out [B, T, D], k, v [B, H, T, Dh]), causal over the given order;
        positions [B, T] (None: 0..T-1) and ``length`` as in ``rope``."""
        q, k, v = self.project_qkv(x, positions, length)
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
        return self.attend(x, positions)[0]

    def decode(self, x: torch.Tensor, positions: torch.Tensor, cache, rows: torch.Tensor) -> torch.Tensor:
        """One new token per row: x [b, 1, D] at ``positions`` [b] for cache rows ``rows`` [b].
        Appends its key/value to the cache, then attends over the row's cached entries."""
        q, k, v = self.project_qkv(x, positions[:, None])
        cache.append(rows, k, v)
        keys, values, mask = cache.view(rows)
        return self.output(F.scaled_dot_product_attention(q, keys, values, attn_mask=mask))
