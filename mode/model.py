"""MoDETransformer: a nanoGPT-shaped causal LM whose blocks follow a per-layer layout.

Legend: B batch, T sequence length, D model dim, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mode.checks import check_int, check_number, fail
from mode.compile import compiled_piece
from mode.config import ModelConfig
from mode.layers.arch import make_norm
from mode.layers.attention import CausalSelfAttention, prepare_rope
from mode.layers.blocks import check_routing
from mode.layers.early_exit import EarlyExit
from mode.layers.kinds import build_block
from mode.layers.kv_cache import KVCache
from mode.routed import check_causal, non_causal_layers

__all__ = ["MoDETransformer", "sample_next"]


IGNORE_INDEX = -100  # targets the loss leaves out (F.cross_entropy's default)


def check_id_tensor(idx: object, name: str, shape: torch.Size | None = None) -> None:
    """``TypeError``/``ValueError`` unless ``idx`` is a non-empty [B, T] integer tensor (of
    ``shape`` when given); the values are ``assert_ids_in_range``'s."""
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(idx).__name__}")
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got {idx.dtype}: pass idx.long()")
    if idx.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(idx.shape)}: expected [batch, seq] (unsqueeze(0) one sequence)")
    if shape is not None and idx.shape != shape:
        raise ValueError(f"{name} has shape {tuple(idx.shape)}: expected the inputs' shape {tuple(shape)}")
    if idx.numel() == 0:
        raise ValueError(f"{name} has shape {tuple(idx.shape)}: the batch and the sequence must be non-empty")


def assert_ids_in_range(idx: torch.Tensor, targets: torch.Tensor | None, vocab_size: int) -> None:
    """Assert on the device, with no host read, that idx [B, T] holds ids in [0, vocab_size)
    and targets [B, T] (optional) ids in [IGNORE_INDEX, vocab_size): on a GPU a bad id stops
    the step with a device-side assert (as the embedding would); on the CPU it raises
    ``RuntimeError`` here. A negative target above the ignore index still fails in the loss."""
    lo, hi = torch.aminmax(idx)
    ok = (lo >= 0) & (hi < vocab_size)
    if targets is not None:
        t_lo, t_hi = torch.aminmax(targets)
        ok = ok & (t_lo >= IGNORE_INDEX) & (t_hi < vocab_size)
    torch._assert_async(ok, f"token ids outside [0, model.vocab_size={vocab_size})")


class MoDETransformer(nn.Module):
    """Causal LM. ``forward(idx [B, T], targets [B, T] | None) -> (logits [B, T, V], loss | None)``.

    ``loss`` is the mean next-token cross-entropy only; routed blocks keep their auxiliary
    losses on themselves (collect them with ``mode.aux_loss(model)``).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.block_kinds = cfg.block_kinds()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # positions="learned" (GPT-2): a position embedding added to the token embedding.
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.positions == "learned" else None
        self.blocks = nn.ModuleList(build_block(kind, cfg) for kind in self.block_kinds)
        for module in self.blocks.modules():
            if isinstance(module, CausalSelfAttention):
                module.set_backend(cfg.attention)
        self.norm = make_norm(cfg.d_model, cfg.arch())
        ee = cfg.early_exit
        self.early_exit = EarlyExit(cfg.n_layers, ee) if ee.enabled else None
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2 style: scale the residual output projections by depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("w2"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:  # GPT-2 style biases; routers already 0
            nn.init.zeros_(module.bias)

    @classmethod
    def from_checkpoint(cls, path, trust_file: bool = False) -> MoDETransformer:
        """The model a ``mode-train`` checkpoint holds (``ckpt.pt`` or a sharded ``ckpt/``), on
        the CPU in eval mode (its config from the checkpoint)."""
        from mode import checkpoint  # noqa: PLC0415  (checkpoint imports this module)

        cfg = checkpoint.checkpoint_config(path, trust_file).model
        with torch.device("meta"):  # the config's shapes, checked against the file's before any memory is spent
            expected = cls(cfg).state_dict()
        checkpoint.check_weights(path, expected, checkpoint.stored_weights(path, trust_file))
        model = cls(cfg)
        checkpoint.load(path, model, trust_file=trust_file)
        return model.eval()

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_emb.weight.numel() if exclude_embedding else n

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        routing: str = "topk",
        caches: list[KVCache] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: [B, T]. ``routing="causal"`` makes every MoD decision per token (no
        token's output depends on later tokens); ``caches`` (from ``new_caches``) are filled
        with the keys/values of the tokens each block computed, for ``decode``.

        Sequences longer than ``seq_len`` run with RoPE (computed per position) but are
        extrapolation: the model was trained on ``seq_len``; learned positions end there.
        """
        self.check_ids(idx, targets=targets)
        check_routing(routing)
        if routing == "causal" or caches is not None:
            check_causal(self, "routing='causal'" if caches is None else "a KV cache")
        positions = None  # 0..T-1 in every block (RoPE rows from one cached table)
        if self.cfg.positions == "rope":
            prepare_rope(idx.shape[1], self.cfg.d_model // self.cfg.n_heads, self.cfg.rope_base, idx.device)
        x = self.embed(idx)
        if self.early_exit is None:
            for i, block in enumerate(self.blocks):
                x = block(x, positions, routing=routing, cache=caches[i] if caches is not None else None)
        else:
            x = self._forward_early_exit(x, positions, routing, caches, targets)
        logits = self.head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def embed(self, idx: torch.Tensor, position: int = 0) -> torch.Tensor:
        """idx: [B, T] tokens at positions ``position``.. -> [B, T, D] (token embedding, plus the
        learned position embedding when ``positions="learned"``)."""
        x = self.tok_emb(idx)
        if self.pos_emb is None:
            return x
        end = position + idx.shape[1]
        if end > self.cfg.seq_len:
            raise ValueError(
                f"position {end - 1} is past model.seq_len={self.cfg.seq_len}: learned position embeddings "
                "end there (positions='rope' extrapolates)"
            )
        return x + self.pos_emb.weight[position:end]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] -> logits [..., V] (final norm + LM head; also every early-exit head)."""
        return self.lm_head(self.norm(x))

    def _forward_early_exit(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None,
        routing: str,
        caches: list[KVCache] | None,
        targets: torch.Tensor | None,
    ) -> torch.Tensor:
        """The blocks with early exit (``mode.layers.early_exit``): in training every block on
        every token plus the exit heads' losses; in evaluation a token exits after the first
        block whose head is confident and keeps that state (later blocks still see it)."""
        ee = self.early_exit
        ee.clear_aux()
        active, shares, layer_logits = None, [], []
        for i, block in enumerate(self.blocks):
            shares.append(1.0 if active is None else active.float().mean())
            out = block(x, positions, routing=routing, cache=caches[i] if caches is not None else None)
            x = out if active is None else torch.where(active.unsqueeze(-1), out, x)
            if not ee.can_exit_after(i):
                continue
            if self.training:
                if targets is not None:
                    layer_logits.append(self.head(x))
                continue
            stay = ~ee.confident(self.head(x))
            active = stay if active is None else active & stay
        if self.training:
            if targets is not None:
                ee.record_exit_losses(layer_logits, targets)
        else:
            ee.record_compute(shares)
        return x

    def check_ids(self, idx: object, name: str = "idx", targets: object = None) -> None:
        """``ValueError``/``TypeError`` unless ``idx`` is a non-empty [B, T] integer tensor of
        ids in [0, vocab_size), and ``targets`` (when given) one of idx's shape whose ids are in
        [0, vocab_size) or the loss's ignore index -100 and above. The values are checked on
        the device in one assert for both (compiled with the blocks: ``compiled_piece``)."""
        check_id_tensor(idx, name)
        if targets is not None:
            check_id_tensor(targets, "targets", shape=idx.shape)
        V = self.cfg.vocab_size
        try:
            compiled_piece(assert_ids_in_range, self)(idx, targets, V)
        except RuntimeError as e:
            for tensor, tensor_name, lowest in ((idx, name, 0), (targets, "targets", IGNORE_INDEX)):
                if tensor is None:
                    continue
                lo, hi = torch.aminmax(tensor)
                if lo < lowest or hi >= V:
                    bad = int(lo) if lo < lowest else int(hi)
                    raise ValueError(
                        f"{tensor_name} holds token id {bad}: ids must be in [0, model.vocab_size={V})"
                    ) from e
            raise

    def new_caches(self, batch: int) -> list[KVCache]:
        """One empty KV cache per block, for ``forward(..., routing="causal", caches=...)`` + ``decode``."""
        p = self.tok_emb.weight
        return [block.new_cache(batch, p.dtype, p.device) for block in self.blocks]

    def decode(self, idx: torch.Tensor, position: int, caches: list[KVCache]) -> torch.Tensor:
        """One token per row, idx: [B, 1] at ``position``, against filled caches -> logits [B, V].
        In a routed block a token that skips costs nothing and writes no KV entry."""
        B = idx.shape[0]
        positions = torch.full((B,), position, dtype=torch.long, device=idx.device)
        x = self.embed(idx, position)
        ee = self.early_exit
        active = torch.ones(B, dtype=torch.bool, device=idx.device)
        for i, (block, cache) in enumerate(zip(self.blocks, caches, strict=True)):
            if ee is None:
                x = block.decode(x, positions, cache)
                continue
            # Exited rows only write their frozen state's keys/values; the others run the block.
            done, rows = (~active).nonzero().squeeze(-1), active.nonzero().squeeze(-1)
            if done.numel():
                block.write_kv_decode(x.index_select(0, done), positions.index_select(0, done), cache, done)
            if rows.numel():
                x_r = x.index_select(0, rows)
                x = x.index_copy(0, rows, x_r + block.delta_decode(x_r, positions.index_select(0, rows), cache, rows))
            if ee.can_exit_after(i) and rows.numel():
                active = active & ~ee.confident(self.head(x[:, -1]))
        return self.head(x)[:, -1]

    def supports_causal(self) -> bool:
        """True when every routed module decides per token (its ``non_causal_reason`` is None),
        so ``routing="causal"`` and KV-cache sampling are exact."""
        return not non_causal_layers(self)

    def default_routing(self) -> str:
        """The routing every tool uses unless told: "causal" where ``supports_causal`` (the one
        routing that can generate, token by token), else "topk" (as trained)."""
        return "causal" if self.supports_causal() else "topk"

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        use_cache: bool | None = None,
        top_p: float | None = None,
        eos_id: int | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``idx`` ([B, T0]) -> [B, T0 + max_new_tokens].

        ``temperature`` 0 is greedy; ``top_k`` keeps the k likeliest ids, ``top_p`` the
        smallest set whose probability reaches p (nucleus). With ``eos_id``, sampling stops
        once every row has produced it (the result is then shorter); a row that ended keeps
        producing ``eos_id``.

        With a KV cache (default when every routed module decides per token, see
        ``supports_causal``, and prompt + new tokens fit in ``seq_len``), routing is causal and
        a skipped token writes no cache entry; ``use_cache=True`` past ``seq_len`` raises
        ``ValueError`` (the cache cannot drop old tokens).
        Without it (the exact fallback for every other model: a MoD block without a causal
        method, a capacity MoE, expert-choice experts), each step re-runs the model's own
        top-k forward on the last ``seq_len`` tokens. ``use_cache=True`` on a model that
        cannot decide per token raises ``ValueError`` naming the layers.
        """
        self.check_ids(idx)
        check_int("max_new_tokens", max_new_tokens)
        if max_new_tokens < 0:
            fail("max_new_tokens", max_new_tokens, "must be >= 0")
        check_number("temperature", temperature)
        if temperature < 0:
            fail("temperature", temperature, "must be >= 0 (0 is greedy)")
        if top_k is not None:
            check_int("top_k", top_k)
            if top_k < 1:
                fail("top_k", top_k, "must be >= 1, or None for no top-k filter")
        if top_p is not None:
            check_number("top_p", top_p)
            if not 0 < top_p <= 1:
                fail("top_p", top_p, "must be in (0, 1], or None for no nucleus filter")
        total = idx.shape[1] + max_new_tokens
        if use_cache is None:
            use_cache = self.supports_causal() and total <= self.cfg.seq_len
        elif use_cache:
            check_causal(self, "generate(use_cache=True)")
        if use_cache and total > self.cfg.seq_len:
            raise ValueError(
                f"prompt length {idx.shape[1]} + max_new_tokens={max_new_tokens} = {total} runs past "
                f"model.seq_len={self.cfg.seq_len}, the positions the model was trained on; the KV cache "
                "cannot drop old tokens: sample fewer tokens, or use_cache=False (each step re-reads the "
                "last seq_len tokens)"
            )
        ended = torch.zeros(idx.shape[0], 1, dtype=torch.bool, device=idx.device)

        def pick(logits: torch.Tensor) -> torch.Tensor:
            nonlocal ended
            nxt = sample_next(logits, temperature, top_k, top_p)
            if eos_id is None:
                return nxt
            nxt = nxt.masked_fill(ended, eos_id)
            ended = ended | (nxt == eos_id)
            return nxt

        if not use_cache:
            for _ in range(max_new_tokens):
                logits, _ = self(idx[:, -self.cfg.seq_len :])
                idx = torch.cat((idx, pick(logits[:, -1, :])), dim=1)
                if eos_id is not None and bool(ended.all()):
                    break
            return idx
        if max_new_tokens <= 0:
            return idx
        caches = self.new_caches(idx.shape[0])
        logits, _ = self(idx, routing="causal", caches=caches)
        out = [idx, pick(logits[:, -1, :])]
        for step in range(max_new_tokens - 1):
            if eos_id is not None and bool(ended.all()):
                break
            logits = self.decode(out[-1], idx.shape[1] + step, caches)
            out.append(pick(logits))
        return torch.cat(out, dim=1)


def sample_next(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """logits: [B, V] -> [B, 1] sampled token ids (greedy when temperature == 0), from the
    ``top_k`` likeliest and/or the smallest set of probability >= ``top_p``."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.shape[-1]))
        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        # drop an id when the ids likelier than it already reach top_p (the likeliest stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
