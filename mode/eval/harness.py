"""An ``lm-evaluation-harness`` model, registered as ``mode`` when this module is imported:

    import lm_eval, mode.eval.harness
    lm_eval.simple_evaluate(model="mode", model_args="pretrained=runs/mod/ckpt.pt", tasks=["hellaswag"])

``pretrained`` is a ``mode-train`` checkpoint (``ckpt.pt`` or ``ckpt/``) or a Hugging Face
directory (``mode.eval.load_model``); ``tokenizer`` (default: the model's own: its data's, or
the directory's ``tokenizer.json``) encodes the requests. ``routing``: "causal" (default for
a model whose routed layers decide per token: no token's score looks at later tokens) or
"topk" (the training forward, which routes over the whole window). Windows are at most the
model's ``seq_len``; longer inputs keep their last ``seq_len`` tokens.

Requires the ``eval`` extra (``pip install 'mode-moe[eval]'``). Importing this module
registers the model under the name ``mode``; the ``mode-lm-eval`` command is lm-eval's own
command line with it registered (``--model mode`` by default). ``device``: as ``train.device``
(default "auto"; a CUDA device asked for on a machine without one is the CPU, said on stderr).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from mode.devices import resolve_device
from mode.eval import load_model
from mode.tokenizer import load_tokenizer

__all__ = ["ModeLM", "harness_device"]


def harness_device(name: str | None) -> torch.device:
    """The device for ``device=name``, resolved as ``train.device`` is: None or "auto" is the
    first CUDA device when there is one, else the CPU. lm-eval's command line passes
    ``cuda:0`` unless told otherwise: on a machine without CUDA that is the CPU, said on stderr."""
    if name is None or name == "auto":
        return resolve_device("auto")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"mode (lm-eval model): device {name!r} but this torch has no CUDA device: using cpu", file=sys.stderr)
        return torch.device("cpu")
    return device


@register_model("mode")
class ModeLM(LM):
    """loglikelihood, loglikelihood_rolling and generate_until with this library's forward."""

    def __init__(
        self,
        pretrained: str,
        tokenizer: str | None = None,
        routing: str | None = None,
        batch_size: int | str = 1,
        device: str | None = "auto",
        **kwargs,
    ) -> None:
        super().__init__()
        self._device = harness_device(device)
        model, data = load_model(pretrained)
        self.model = model.to(self._device).eval()
        spec = tokenizer or data["tokenizer"]
        if spec is None:
            raise ValueError(f"{pretrained} names no tokenizer: pass model_args tokenizer=<bytes|tokenizer.json>")
        self.tok = load_tokenizer(spec)
        self.routing = routing or self.model.default_routing()
        if self.routing not in ("topk", "causal"):
            raise ValueError(f"routing={self.routing!r}: choose topk or causal")
        self.device_name = str(self._device)

    @property
    def max_length(self) -> int:
        return self.model.cfg.seq_len

    @torch.no_grad()
    def _logprobs(self, ids: list[int]) -> torch.Tensor:
        """[len(ids) - 1, V] log-probabilities of each next id (the window's last seq_len + 1)."""
        ids = ids[-(self.max_length + 1) :]
        x = torch.tensor(ids[:-1], dtype=torch.long, device=self.device_name)[None]
        logits, _ = self.model(x, routing=self.routing)
        return F.log_softmax(logits[0].float(), dim=-1)

    def _context(self, context: str) -> list[int]:
        ids = self.tok.encode(context)
        if not ids and self.tok.eos_id is not None:
            ids = [self.tok.eos_id]
        return ids

    def loglikelihood_one(self, context: str, continuation: str) -> tuple[float, bool]:
        """(log p(continuation | context), whether greedy decoding gives the continuation)."""
        ctx, cont = self._context(context), self.tok.encode(continuation)
        if not ctx or not cont:
            raise ValueError("loglikelihood needs a non-empty context (or an end-of-text id) and continuation")
        logprobs = self._logprobs(ctx + cont)[-len(cont) :]
        target = torch.tensor(cont, device=logprobs.device)
        score = logprobs.gather(1, target[:, None]).sum().item()
        return score, bool((logprobs.argmax(-1) == target).all())

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return [self.loglikelihood_one(*r.args) for r in requests]

    def loglikelihood_rolling(self, requests) -> list[float]:
        """log p(text): every id scored once, in consecutive windows of ``seq_len`` (the first
        id given the end-of-text id when the tokenizer has one, else left unscored)."""
        out = []
        for r in requests:
            ids = ([self.tok.eos_id] if self.tok.eos_id is not None else []) + self.tok.encode(r.args[0])
            total, T = 0.0, self.max_length
            for start in range(0, len(ids) - 1, T):
                window = ids[start : start + T + 1]
                logprobs = self._logprobs(window)
                target = torch.tensor(window[1:], device=logprobs.device)
                total += logprobs.gather(1, target[:, None]).sum().item()
            out.append(total)
        return out

    def generate_until(self, requests) -> list[str]:
        out = []
        for r in requests:
            context, kwargs = r.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(kwargs.get("max_gen_toks", 32))
            sample = kwargs.get("do_sample", False)
            temperature = float(kwargs.get("temperature", 0.0)) if sample else 0.0
            ctx = self._context(context)[-max(1, self.max_length - new) :]
            prompt = torch.tensor(ctx, dtype=torch.long, device=self.device_name)[None]
            ids = self.model.generate(prompt, new, temperature=temperature, eos_id=self.tok.eos_id)
            text = self.tok.decode(ids[0, len(ctx) :].tolist())
            cut = min((text.find(u) for u in until if u and u in text), default=len(text))
            out.append(text[:cut])
        return out
