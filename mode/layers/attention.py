"""Causal multi-head (or grouped-query) attention with RoPE at the tokens' original positions.

Legend: B batch, T tokens (possibly a routed subset), H query heads, Hkv key/value heads (a
divisor of H: query head h reads key/value head h // (H / Hkv)), Dh head dim, D = H * Dh.
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

from mode.layers.arch import DEFAULT_ARCH, Arch, RMSNorm

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
    """q: [B, H, T, Dh], k, v: [B, Hkv, T, Dh] -> [B, H, T, Dh], causal in token order
    (xformers' layout is [B, T, H, Dh]; grouped key/value heads are repeated for it)."""
    import xformers.ops as xops  # noqa: PLC0415

    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    y = xops.memory_efficient_attention(q, k, v, attn_bias=xops.LowerTriangularMask())
    return y.transpose(1, 2)


def attention_flops(n: int, d: int, masked: bool = True, kv_share: float = 1.0) -> int:
    """Forward FLOPs (2 per multiply-add) of attention over n tokens: QKV + output projections
    (4 n D^2 for Q and the output, 4 n D^2 * kv_share for K and V, where kv_share = Hkv / H)
    and scores/values, 4 n^2 D with the causal mask's masked half counted (``masked=True``, as
    ``FlopCounterMode``), else 2 n (n+1) D (what a flash kernel computes)."""
    scores = 4 * n * n * d if masked else 2 * n * (n + 1) * d
    return 4 * n * d * d + round(4 * n * d * d * kv_share) + scores


def rope_rows(positions: torch.Tensor, head_dim: int, base: float) -> torch.Tensor:
    """positions: [...] integer -> [..., 2, Dh] float32 rows ``(C, S)`` with C = (cos, cos) and
    S = (-sin, sin) of each pair's angle, so that RoPE is ``x * C + swap_halves(x) * S``."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [..., Dh/2]
    cos, sin = angles.cos(), angles.sin()
    return torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=-2)


# (device, head_dim, base) -> [L, 2, Dh] rows of positions 0..L-1, grown on demand: computed
# once per process for every layer and step, not once per layer per forward; and the
# (C, S) views [T, Dh] of its first T rows, so a dense block's RoPE costs no table op.
_ROPE_TABLES: dict[tuple[str, int, float], torch.Tensor] = {}
_ROPE_PREFIXES: dict[tuple[str, int, float, int], tuple[torch.Tensor, torch.Tensor]] = {}


def rope_table(length: int, head_dim: int, base: float, device: torch.device) -> torch.Tensor:
    """[length, 2, Dh] ``rope_rows`` of positions 0..length-1 (a cached table's first rows).
    Under ``torch.compile`` the cache is read, never written (a compiled graph cannot store
    into it): a table an eager caller made (``prepare_rope``) is a graph input, else the
    rows are computed in the graph."""
    key = (str(device), head_dim, float(base))
    table = _ROPE_TABLES.get(key)
    if torch.compiler.is_compiling():
        if table is not None and table.shape[0] >= length:
            return table[:length]
        return rope_rows(torch.arange(length, device=device), head_dim, base)
    if table is None or table.shape[0] < length:
        size = max(length, 2 * table.shape[0] if table is not None else 256)
        # NOTE: made outside inference mode so that a table first built while sampling can
        # still be saved for backward by a later training step.
        with torch.inference_mode(False), torch.no_grad():
            table = rope_rows(torch.arange(size, device=device), head_dim, base)
        _ROPE_TABLES[key] = table
    return table[:length]


def rope_prefix(length: int, head_dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, S): [length, Dh] each, the RoPE factors of positions 0..length-1, which broadcast
    over heads-major [B, H, T, Dh] (cached views of ``rope_table``; read-only under compile)."""
    key = (str(device), head_dim, float(base), length)
    cached = _ROPE_PREFIXES.get(key)
    if cached is None:
        rows = rope_table(length, head_dim, base, device)  # [T, 2, Dh]
        cached = rows[:, 0], rows[:, 1]
        if not torch.compiler.is_compiling():
            _ROPE_PREFIXES[key] = cached
    return cached


def prepare_rope(length: int, head_dim: int, base: float, device: torch.device) -> None:
    """Fill the RoPE caches for sequences of ``length`` eagerly, before compiled blocks run:
    they then read the table as an input instead of recomputing it in every block's graph
    (4 of a dense block's 11 forward kernels). A model calls it once per forward."""
    if not torch.compiler.is_compiling():
        rope_prefix(length, head_dim, base, device)


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
    """x rotated by RoPE: x [B, H, T, Dh] (the query and key heads together), c and s its
    factors broadcast to x (``rope_prefix``'s [T, Dh], or [B, 1, T, Dh] gathered rows)."""
    return _Rope.apply(x, c, s)


class CausalSelfAttention(nn.Module):
    """x: [B, T, D] -> [B, T, D]; causal over the given token order (positions ascending)."""

    def __init__(self, d_model: int, n_heads: int, arch: Arch = DEFAULT_ARCH) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.n_kv_heads = arch.kv_heads(n_heads)
        self.head_dim = d_model // n_heads
        if arch.rope and self.head_dim % 2:
            raise ValueError(f"head dim d_model/n_heads={self.head_dim} must be even for RoPE")
        self.use_rope = arch.rope
        self.rope_base = arch.rope_base
        width = (n_heads + 2 * self.n_kv_heads) * self.head_dim  # q, k, v heads in this order
        self.qkv = nn.Linear(d_model, width, bias=arch.bias or arch.qkv_bias)
        self.proj = nn.Linear(d_model, d_model, bias=arch.bias)
        # qk_norm: RMSNorm over all query heads at once and over all key heads (OLMoE)
        self.q_norm = RMSNorm(d_model, arch.norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.n_kv_heads * self.head_dim, arch.norm_eps) if arch.qk_norm else None
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
        """RoPE factors (C, S) for T tokens at ``positions`` [B, T] (None: 0..T-1, [T, Dh]
        views of the cached table), else [B, 1, T, Dh]. ``length`` bounds the positions
        (e.g. the full sequence a routed block gathered from): the rows are then one gather
        from the cached table; without it they are computed from the positions."""
        if positions is None:
            return rope_prefix(T, self.head_dim, self.rope_base, self.qkv.weight.device)
        if length is not None:
            rows = rope_table(length, self.head_dim, self.rope_base, positions.device)[positions]
        else:
            rows = rope_rows(positions, self.head_dim, self.rope_base)
        rows = rows[:, None]  # [B, 1, T, 2, Dh]
        return rows[..., 0, :], rows[..., 1, :]

    def project_qkv(
        self, x: torch.Tensor, positions: torch.Tensor | None, length: int | None = None
    ) -> tuple[torch.Tensor, ...]:
        """x: [B, T, D], positions: [B, T] (None: 0..T-1; ``length`` as in ``rope``) -> q
        [B, H, T, Dh], k, v [B, Hkv, T, Dh] with RoPE applied to q and k (one rotation of both)."""
        B, T, D = x.shape
        H, Hkv = self.n_heads, self.n_kv_heads
        projected = self.qkv(x)
        if self.q_norm is not None:
            q, k, v = projected.split((H * self.head_dim, Hkv * self.head_dim, Hkv * self.head_dim), dim=-1)
            projected = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
        qkv = projected.view(B, T, H + 2 * Hkv, self.head_dim).transpose(1, 2)  # [B, H + 2 Hkv, T, Dh]
        qk, v = qkv.split((H + Hkv, Hkv), dim=1)
        if not self.use_rope:
            q, k = qk.split((H, Hkv), dim=1)
            return q, k, v
        c, s = self.rope(positions, T, length)
        if torch.compiler.is_compiling():
            # NOTE: compiled, one rotation per output lets each be written where attention
            # reads it (one kernel each); one rotation of both would be a third buffer to split.
            q, k = qk.split((H, Hkv), dim=1)
            return apply_rope(q, c, s), apply_rope(k, c, s), v
        q, k = apply_rope(qk, c, s).split((H, Hkv), dim=1)  # eager: one rotation of both
        return q, k, v

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """y: [B, H, T, Dh] -> [B, T, D]."""
        B, H, T, Dh = y.shape
        return self.proj(y.transpose(1, 2).reshape(B, T, H * Dh))

    def attend(
        self, x: torch.Tensor, positions: torch.Tensor | None, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, D] -> (out [B, T, D], k, v [B, Hkv, T, Dh]), causal over the given order;
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
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.grouped)
        return self.output(y), k, v

    @property
    def grouped(self) -> bool:
        """Whether key/value heads serve groups of query heads (grouped-query attention)."""
        return self.n_kv_heads != self.n_heads

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.attend(x, positions)[0]

    def decode(self, x: torch.Tensor, positions: torch.Tensor, cache, rows: torch.Tensor) -> torch.Tensor:
        """One new token per row: x [b, 1, D] at ``positions`` [b] for cache rows ``rows`` [b].
        Appends its key/value to the cache, then attends over the row's cached entries."""
        q, k, v = self.project_qkv(x, positions[:, None])
        cache.append(rows, k, v)
        keys, values, mask = cache.view(rows)
        return self.output(F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.grouped))
