"""Hugging Face checkpoints in and out (``mode.hf``): tiny random models made here with
``transformers`` and saved to a temporary directory (no network); logits and greedy tokens
compared both ways, HF -> mode -> HF."""

from __future__ import annotations

import json

import pytest
import torch

from mode.checkpoint import checkpoint_config, load_checkpoint
from mode.config import load_config
from mode.convert import upcycle
from mode.hf import UnsupportedCheckpoint, config_from_hf, from_hf, to_hf
from mode.model import MoDETransformer
from mode.train import main
from tests.tolerances import assert_close

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

V, T = 96, 16
SHAPE = {"vocab_size": V, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
LLAMA = {**SHAPE, "intermediate_size": 48, "num_key_value_heads": 2, "max_position_embeddings": 64}
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**LLAMA, "rope_theta": 500000.0}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**LLAMA, "sliding_window": 32}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**LLAMA, "tie_word_embeddings": True}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"vocab_size": V, "n_embd": 32, "n_layer": 2, "n_head": 4}),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {**LLAMA, "intermediate_size": 24, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen2_moe": (  # a dense first layer (mlp_only_layers), then an MoE with a gated shared expert
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            **LLAMA,
            "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 40,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mlp_only_layers": [0],
            "tie_word_embeddings": False,
        },
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        {**LLAMA, "intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False},
    ),
}
IDX = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))


def hf_model(family: str, seed: int = 0, **changes):
    """A tiny random ``transformers`` model of ``family`` whose weights are large enough that
    its logits spread over several units (a wrong layout then shows far above tolerance)."""
    import transformers

    config_cls, model_cls, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**kwargs, **changes}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = "norm" in name or ".ln_" in name
            p.copy_((1.0 if is_norm and name.endswith("weight") else 0.0) + 0.15 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    """(family, HF model, its checkpoint directory)."""
    model = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def logits(model, idx=IDX) -> torch.Tensor:
    with torch.no_grad():
        out = model(idx)
    return out[0] if isinstance(out, tuple) else out.logits


def test_from_hf_computes_the_hf_logits(saved):
    family, hf, path = saved
    ours = from_hf(path)
    want = logits(hf)
    assert want.std() > 0.5, "logits too flat to tell a wrong layout"
    assert_close(logits(ours), want, "model")
    layouts = {"mixtral": "moe", "olmoe": "moe", "qwen2_moe": "dense,moe"}
    assert ours.cfg.layout == layouts.get(family, "dense")


def test_to_hf_gives_transformers_our_logits_and_greedy_tokens(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    family, hf, path = saved
    ours = from_hf(path)
    back = AutoModelForCausalLM.from_pretrained(to_hf(ours, tmp_path / "out")).eval()
    exported_as = {"mistral": "LlamaForCausalLM"}  # within its window Mistral is Llama
    assert type(back).__name__ == exported_as.get(family, type(hf).__name__)
    assert_close(logits(back), logits(ours), "model")
    prompt = IDX[:, :5]
    with torch.no_grad():
        # NOTE: an explicit mask: from a pad id, generate would mask that id in the prompt
        mask = torch.ones_like(prompt)
        theirs = back.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 8, temperature=0.0), theirs)


def test_bf16_checkpoints_load_within_bf16_tolerance(tmp_path):
    hf = hf_model("llama").to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path, dtype=torch.bfloat16)
    assert ours.tok_emb.weight.dtype == torch.bfloat16
    assert_close(logits(ours).float(), logits(hf).float(), "model", dtype=torch.bfloat16)


def test_sharded_checkpoints_load_whole(tmp_path):
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    assert_close(logits(from_hf(tmp_path)), logits(hf), "model")


def test_mistral_sliding_window_becomes_the_sequence_length(tmp_path):
    hf_model("mistral").save_pretrained(tmp_path)
    assert from_hf(tmp_path).cfg.seq_len == 32


def test_mixtral_experts_in_transformers_5s_fused_layout_load_too(tmp_path):
    from safetensors.torch import save_file

    hf = hf_model("mixtral")
    hf.save_pretrained(tmp_path)  # the per-expert layout on disk
    fused = {k: v.contiguous() for k, v in hf.state_dict().items()}  # in memory: gate_up_proj, down_proj
    assert any(k.endswith("experts.gate_up_proj") for k in fused)
    save_file(fused, tmp_path / "model.safetensors")
    assert_close(logits(from_hf(tmp_path)), logits(hf), "model")


@pytest.mark.parametrize(
    "change,named",
    [
        ({"model_type": "deepseek_v3"}, "model_type='deepseek_v3'"),
        ({"model_type": "qwen3"}, "q_norm"),
        ({"model_type": "olmoe", "num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 8.0}, "clip_qkv=8.0"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope type 'linear'"),
        ({"head_dim": 16}, "head_dim=16"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 1}, "num_experts_per_tok=1"),
    ],
)
def test_unsupported_configs_are_refused_by_field(change, named):
    c = {"model_type": "llama", **LLAMA, "hidden_act": "silu", **change}
    with pytest.raises(UnsupportedCheckpoint, match=named):
        config_from_hf(c)


def test_several_problems_are_named_together():
    c = {"model_type": "llama", **LLAMA, "head_dim": 16, "mlp_bias": True}
    with pytest.raises(UnsupportedCheckpoint) as err:
        config_from_hf(c)
    assert "head_dim=16" in str(err.value) and "mlp_bias=true" in str(err.value)


def test_a_checkpoint_missing_a_tensor_is_refused_by_key(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_model("llama").save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.extra.weight"] = torch.zeros(1)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedCheckpoint, match="model.layers.1.mlp.up_proj.weight"):
        from_hf(tmp_path)


def test_a_checkpoint_with_an_unknown_tensor_is_refused_by_key(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_model("llama").save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedCheckpoint, match="q_norm"):
        from_hf(tmp_path)


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["model.layout=dense,mod"], "model.layout='dense,mod'"),
        ([], "architecture norm=layernorm, mlp=gelu"),
        (
            ["model.layout=moe", "model.norm=rmsnorm", "model.mlp=swiglu", "model.moe.mlp=gelu"],
            "model.moe.mlp='gelu'",
        ),
        (["model.layout=moe", "model.norm=rmsnorm", "model.mlp=swiglu", "model.moe.top_k=1"], "model.moe.top_k=1"),
        (
            ["model.layout=dense", "model.norm=rmsnorm", "model.mlp=swiglu", "model.early_exit.enabled=true"],
            "model.early_exit.enabled=true",
        ),
    ],
)
def test_native_export_refuses_what_no_family_holds_before_writing(overrides, named, tmp_path):
    cfg = load_config(None, ["model.d_model=32", "model.n_heads=4", "model.n_layers=2", *overrides]).model
    with pytest.raises(UnsupportedCheckpoint, match=named):
        to_hf(MoDETransformer(cfg), tmp_path / "out", native=True)
    assert not (tmp_path / "out").exists()


REMOTE = [
    ("dense,mod", "topk", []),
    ("mod,mode_staged", "causal", ["model.mod.causal=predictor"]),
    ("mode_integrated", "topk", ["model.moe.n_noop=2", "model.moe.top_k=1"]),
    ("dense", "topk", []),  # this library's default architecture: no family holds it
]


@pytest.mark.parametrize("layout,routing,extra", REMOTE, ids=[f"{a}-{r}" for a, r, _ in REMOTE])
def test_models_no_family_holds_export_with_their_modeling_file(layout, routing, extra, tmp_path):
    from transformers import AutoModelForCausalLM

    overrides = ["model.d_model=32", "model.n_heads=4", "model.n_layers=2", "model.seq_len=32", *extra]
    cfg = load_config(None, [*overrides, f"model.layout={layout}"]).model
    torch.manual_seed(0)
    ours = MoDETransformer(cfg).eval()
    with torch.no_grad():
        for p in ours.parameters():  # spread the logits: a wrong weight would show
            p.add_(0.1 * torch.randn_like(p))
    out = to_hf(ours, tmp_path / "out", routing=routing)
    assert (out / "modeling_mode.py").is_file()
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(out)
    back = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ours(idx, routing=routing)[0]
    assert want.std() > 0.5
    assert_close(logits(back, idx), want, "exact")
    prompt = idx[:, :4]
    mask = torch.ones_like(prompt)
    with torch.no_grad():
        theirs = back.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(theirs, ours.generate(prompt, 6, temperature=0.0, use_cache=routing == "causal"))
    assert_close(logits(from_hf(out), idx), ours(idx)[0], "exact")  # and back into mode


def test_the_written_config_is_plain_json_with_the_family(saved, tmp_path):
    family, _, path = saved
    out = to_hf(from_hf(path), tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["model_type"] == ("llama" if family == "mistral" else family)


IDENTITY = {
    "mod": ["model.mod.capacity=1.0", "model.mod.gate=none"],  # every token routed, unit gate
    "moe": ["model.moe.n_experts=1", "model.moe.top_k=1"],  # one expert, the dense MLP
    "mode_staged": ["model.mod.capacity=1.0", "model.mod.gate=none", "model.moe.n_experts=1", "model.moe.top_k=1"],
}


def test_upcycling_a_published_model_into_integrated_mode_fills_its_experts(tmp_path):
    """No identity setting exists (no-op experts take a share): the experts hold the
    published MLP's hidden slices and the model computes finite logits."""
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path)
    model = upcycle(f"hf:{tmp_path}", load_config("mode_integrated", ["model.moe.top_k=2"])).eval()
    mlp = hf.model.layers[1].mlp
    experts = model.blocks[1].mlp.experts
    assert_close(experts.w1[0], mlp.gate_proj.weight[:24].T, "exact")
    assert_close(experts.w3[1], mlp.up_proj.weight[24:].T, "exact")
    assert torch.isfinite(logits(model)).all()


@pytest.mark.parametrize("preset", list(IDENTITY))
def test_upcycling_a_published_model_at_the_identity_settings_keeps_its_logits(preset, tmp_path):
    """The preset's own width and architecture give way to the published model's."""
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path)
    model = upcycle(f"hf:{tmp_path}", load_config(preset, IDENTITY[preset])).eval()
    assert (model.cfg.d_model, model.cfg.norm, model.cfg.n_kv_heads) == (32, "rmsnorm", 2)
    assert_close(logits(model), logits(hf), "model")


@pytest.mark.slow
def test_mode_train_init_from_a_published_model_trains_and_exports(tmp_path):
    """Llama in, a trained MoE out as Mixtral: transformers computes the trained model's logits."""
    from transformers import AutoModelForCausalLM

    hf_model("llama", vocab_size=256).save_pretrained(tmp_path / "llama")  # the byte corpus needs 256 ids
    run = [f"train.out_dir={tmp_path / 'run'}", "train.steps=3", "train.eval_every=3", "train.batch_size=2"]
    run += ["model.seq_len=32", "train.progress=false", "train.max_seconds=0", "train.eval_batches=1"]
    main(["--config", "moe", "--init-from", f"hf:{tmp_path / 'llama'}", "model.layout=moe", *run])
    cfg = checkpoint_config(tmp_path / "run" / "ckpt.pt").model
    assert (cfg.d_model, cfg.n_kv_heads, cfg.layout, cfg.moe.mlp, cfg.moe.d_ff) == (32, 2, "moe", "swiglu", 24)
    model = MoDETransformer(cfg)
    load_checkpoint(tmp_path / "run" / "ckpt.pt", model)
    model.eval()
    back = AutoModelForCausalLM.from_pretrained(to_hf(model, tmp_path / "out")).eval()
    assert type(back).__name__ == "MixtralForCausalLM"
    idx = torch.randint(0, 256, (2, 16))
    assert_close(logits(back, idx), logits(model, idx), "model")
