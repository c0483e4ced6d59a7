"""The modeling file ``to_hf`` writes beside a MoD or MoDE checkpoint (``modeling_mode.py``):
``transformers.AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` loads it.

It wraps ``mode.model.MoDETransformer`` (so the ``mode-moe`` package must be installed where
the checkpoint is loaded): the forward is this library's own, in the routing the exported
config names (``routing``: "topk", as trained, or "causal", per-token decisions). Generation
re-reads the whole sequence at every step (no ``transformers`` cache).
"""

from __future__ import annotations

import torch
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class MoDEConfig(PretrainedConfig):
    """``mode_config``: the ``model`` section of a mode-moe config (``mode.config.ModelConfig``
    as a dict); ``routing``: "topk" or "causal"."""

    model_type = "mode_moe"

    def __init__(self, mode_config: dict | None = None, routing: str = "topk", **kwargs) -> None:
        self.mode_config = mode_config or {}
        self.routing = routing
        # the shape, for transformers' own bookkeeping (generation reads some of it)
        self.num_hidden_layers = self.mode_config.get("n_layers", 1)
        self.hidden_size = self.mode_config.get("d_model", 1)
        self.num_attention_heads = self.mode_config.get("n_heads", 1)
        kwargs.setdefault("tie_word_embeddings", False)  # the wrapped model ties its own head
        kwargs.setdefault("use_cache", False)  # generation re-reads the sequence: no transformers cache
        super().__init__(**kwargs)


class MoDEForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MoDEConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: MoDEConfig) -> None:
        super().__init__(config)
        from mode.config import from_dict
        from mode.model import MoDETransformer

        self.model = MoDETransformer(from_dict({"model": config.mode_config}).model)
        self.post_init()

    def _init_weights(self, module) -> None:
        pass  # the weights come from the checkpoint; MoDETransformer initializes its own

    def get_input_embeddings(self):
        return self.model.tok_emb

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutput:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("padded batches are not supported: every row must be a full sequence (mask all ones)")
        logits, _ = self.model(input_ids, routing=self.config.routing)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs
    ) -> dict:
        T = self.model.cfg.seq_len
        mask = attention_mask[:, -T:] if attention_mask is not None else None
        return {"input_ids": input_ids[:, -T:], "attention_mask": mask}
