"""Hugging Face checkpoints in and out: ``from_hf(dir)`` and ``to_hf(model, dir)``.

A checkpoint directory holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). Reading needs ``safetensors`` only (``pip install
'mode-moe[hf]'``); ``transformers`` is not imported.

One adapter per family (``config.json``'s ``model_type``), each implementing the protocol of
``mode.hf.family`` and listed in ``mode.hf.registry``:

- ``mode.hf.llama``: ``llama``, ``mistral``, ``qwen2`` (dense; Llama blocks);
- ``mode.hf.gpt2``: ``gpt2`` (dense; biased LayerNorm, tanh-GELU, learned positions);
- ``mode.hf.moe_families``: ``mixtral``, ``olmoe`` (query/key norms) and ``qwen2_moe`` (a
  gated shared expert, dense blocks between the MoE ones).

``mode.hf.checkpoint`` drives them (``from_hf``, ``to_hf``, ``config_from_hf``,
``hf_family``); ``mode.hf.files`` reads and writes the directory's files; ``mode.hf.cli`` is
``mode-export``.

``to_hf`` writes a model in the first family that holds it, so that
``AutoModelForCausalLM.from_pretrained(dir)`` computes this model's logits; ``moe`` models with
no family of their own are written as Mixtral, in the per-expert layout every transformers
version loads. Every other model (MoD and MoDE layouts, which transformers has no block for,
no-op, capacity or expert-choice experts, a non-zero aux-loss-free bias, architectures no
family has such as this library's default) is written with a modeling file,
``modeling_mode.py`` (``mode.hf_modeling``), that ``from_pretrained(dir, trust_remote_code=True)``
loads: it wraps this library's own model (``mode-moe`` must be installed there), in top-k or
causal routing. ``native=True`` refuses such a model instead, naming every field that keeps it
from a family.

Refused on reading, by field (``UnsupportedCheckpoint``): RoPE scaling, a head dim other than
``hidden_size / num_attention_heads``, attention or MLP biases in Llama, sliding windows on
some layers only, Mixtral's top-1 and router jitter, OLMoE's ``clip_qkv``.
"""

from mode.hf.checkpoint import config_from_hf, from_hf, hf_family, state_from_hf, to_hf
from mode.hf.cli import main
from mode.hf.files import UnsupportedCheckpoint, hf_config, read_hf_state
from mode.hf.registry import FAMILIES, MOE_FAMILIES

__all__ = [
    "FAMILIES",
    "MOE_FAMILIES",
    "UnsupportedCheckpoint",
    "config_from_hf",
    "from_hf",
    "hf_config",
    "hf_family",
    "main",
    "read_hf_state",
    "state_from_hf",
    "to_hf",
]
