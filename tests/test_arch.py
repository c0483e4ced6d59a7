"""The architecture options (``mode.layers.arch``: norm, MLP, grouped-query attention, biases,
learned positions) in every block kind: training, FLOP counts, KV-cache decoding, compile,
upcycling, and the references each option is computed against."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from mode.checks import ConfigError
from mode.compile import compile_blocks
from mode.config import load_config
from mode.convert import upcycle
from mode.flops import block_flops
from mode.layers.arch import Arch, RMSNorm
from mode.layers.attention import CausalSelfAttention
from mode.layers.kinds import BLOCK_KINDS
from mode.layers.mlp import MLP
from mode.model import MoDETransformer, build_block
from mode.routed import aux_loss
from tests.test_flops import REL_TOL, counted_flops
from tests.tiny import TINY_MODEL
from tests.tolerances import assert_close

ARCHS = {
    "gpt2": ["model.mlp=gelu_tanh", "model.bias=true", "model.positions=learned"],
    "llama_gqa": [
        "model.norm=rmsnorm",
        "model.norm_eps=1e-6",
        "model.mlp=swiglu",
        "model.d_ff=48",
        "model.n_kv_heads=2",
        "model.tie_embeddings=false",
        "model.rope_base=500000",
        "model.moe.mlp=swiglu",
    ],
    "qwen2": ["model.norm=rmsnorm", "model.mlp=swiglu", "model.n_kv_heads=1", "model.qkv_bias=true"],
    "olmoe": ["model.norm=rmsnorm", "model.mlp=swiglu", "model.qk_norm=true", "model.moe.mlp=swiglu"],
}


def arch_config(arch: str, *extra: str):
    return load_config(None, [*TINY_MODEL, *ARCHS[arch], *extra]).model


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("kind", list(BLOCK_KINDS))
def test_every_kind_trains_in_every_architecture(kind, arch):
    noop = ["model.moe.n_noop=2"] if BLOCK_KINDS[kind].has_noop_experts else []
    cfg = arch_config(arch, f"model.layout={kind}", *noop)
    torch.manual_seed(0)
    model = MoDETransformer(cfg).train()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    _, loss = model(idx, idx)
    (loss + aux_loss(model)).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert all(torch.isfinite(g).all() for g in grads.values())
    names = list(grads)
    attn = next(m for m in model.modules() if isinstance(m, CausalSelfAttention))
    assert attn.n_kv_heads == (cfg.n_kv_heads or cfg.n_heads)
    assert any(n.endswith("attn.qkv.bias") for n in names) == (cfg.bias or cfg.qkv_bias)
    assert any(n.endswith("attn.proj.bias") for n in names) == cfg.bias
    assert ("pos_emb.weight" in names) == (cfg.positions == "learned")
    assert any(n.endswith("attn.q_norm.weight") for n in names) == cfg.qk_norm
    assert isinstance(model.norm, RMSNorm) == (cfg.norm == "rmsnorm")
    assert (model.lm_head.weight is model.tok_emb.weight) == cfg.tie_embeddings


FLOP_CASES = [(k, a) for a in ("gpt2", "llama_gqa") for k in ("dense", "mod", "moe", "mode_staged")]


@pytest.mark.parametrize("kind,arch", FLOP_CASES, ids=[f"{k}-{a}" for k, a in FLOP_CASES])
def test_block_flops_match_the_counter_in_each_architecture(kind, arch):
    cfg = arch_config(arch, "model.d_model=64", "model.seq_len=128", "model.moe.backend=torch")
    block = build_block(kind, cfg)
    x = torch.randn(2, cfg.seq_len, cfg.d_model)
    measured = counted_flops(lambda: block(x)) / 2
    assert measured == pytest.approx(block_flops(kind, cfg), rel=REL_TOL)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("layout", ["mod", "mode_staged"])
def test_kv_cache_decoding_equals_the_causal_forward(layout, arch):
    cfg = arch_config(arch, f"model.layout=dense,{layout}", "model.mod.causal=predictor", "model.mod.capacity=0.5")
    torch.manual_seed(0)
    model = MoDETransformer(cfg).eval()
    prompt = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        caches = model.new_caches(2)
        logits, _ = model(prompt, routing="causal", caches=caches)
        seq, step_logits = prompt, [logits[:, -1]]
        for s in range(10):
            seq = torch.cat([seq, step_logits[-1].argmax(-1, keepdim=True)], dim=1)
            step_logits.append(model.decode(seq[:, -1:], 6 + s, caches))
        full, _ = model(seq, routing="causal")
    if cfg.n_kv_heads:  # the cache holds only the key/value heads
        assert caches[0].k.shape[1] == cfg.n_kv_heads
    for s, lg in enumerate(step_logits):
        assert_close(lg, full[:, 5 + s], "model")


def test_grouped_query_attention_is_attention_with_each_key_value_head_repeated_for_its_group():
    torch.manual_seed(0)
    D, H, Hkv, Dh = 32, 4, 2, 8
    gqa = CausalSelfAttention(D, H, Arch(n_kv_heads=Hkv, qkv_bias=True))
    mha = CausalSelfAttention(D, H, Arch(qkv_bias=True))
    with torch.no_grad():
        wq, wk, wv = gqa.qkv.weight.split((H * Dh, Hkv * Dh, Hkv * Dh))
        bq, bk, bv = gqa.qkv.bias.split((H * Dh, Hkv * Dh, Hkv * Dh))

        def repeat(t):  # [Hkv * Dh, ...] -> [H * Dh, ...]: query head h reads key/value head h // (H / Hkv)
            return t.view(Hkv, Dh, *t.shape[1:]).repeat_interleave(H // Hkv, 0).reshape(H * Dh, *t.shape[1:])

        mha.qkv.weight.copy_(torch.cat((wq, repeat(wk), repeat(wv))))
        mha.qkv.bias.copy_(torch.cat((bq, repeat(bk), repeat(bv))))
        mha.proj.load_state_dict(gqa.proj.state_dict())
    x = torch.randn(2, 10, D)
    assert_close(gqa(x), mha(x), "layer")


def test_rmsnorm_and_the_mlps_equal_their_formulas():
    torch.manual_seed(0)
    x = torch.randn(3, 16)
    norm = RMSNorm(16, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    assert_close(norm(x), norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), "elementwise")
    swiglu = MLP(16, 24, Arch(mlp="swiglu"))
    assert_close(swiglu(x), swiglu.proj(F.silu(swiglu.fc(x)) * swiglu.up(x)), "exact")
    tanh = MLP(16, 24, Arch(mlp="gelu_tanh", bias=True))
    h = tanh.fc(x)
    gelu_tanh = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    assert_close(tanh(x), tanh.proj(gelu_tanh), "elementwise")


def test_learned_positions_are_added_and_end_at_seq_len():
    cfg = arch_config("gpt2")
    model = MoDETransformer(cfg).eval()
    idx = torch.randint(0, 256, (1, 4))
    assert_close(model.embed(idx, 3), model.tok_emb(idx) + model.pos_emb.weight[3:7], "exact")
    with pytest.raises(ValueError, match="past model.seq_len=32: learned position embeddings end there"):
        model(torch.randint(0, 256, (1, 33)))


@pytest.mark.parametrize(
    "override,field",
    [
        ("model.n_kv_heads=3", "model.n_kv_heads"),
        ("model.norm=batchnorm", "model.norm"),
        ("model.mlp=relu", "model.mlp"),
        ("model.positions=alibi", "model.positions"),
        ("model.norm_eps=0", "model.norm_eps"),
        ("model.moe.shared_gate=true", "model.moe.shared_gate"),  # there is no shared expert to gate
    ],
)
def test_bad_architecture_options_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, [*TINY_MODEL, override])


def test_upcycling_a_swiglu_gqa_model_keeps_its_function():
    """One SwiGLU expert equal to the dense MLP, top-1: the MoE model is the dense one."""
    dense_cfg = arch_config("llama_gqa", "model.layout=dense")
    torch.manual_seed(0)
    dense = MoDETransformer(dense_cfg).eval()
    target = arch_config("llama_gqa", "model.layout=dense,moe", "model.moe.n_experts=1", "model.moe.top_k=1")
    target.moe.d_ff = 48
    moe = upcycle(dense, target).eval()
    idx = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert_close(moe(idx)[0], dense(idx)[0], "layer")
    with pytest.raises(ConfigError, match="model.moe.mlp"):
        upcycle(dense, arch_config("llama_gqa", "model.layout=moe", "model.moe.mlp=gelu"))
    gpt2 = MoDETransformer(arch_config("gpt2", "model.layout=dense"))
    with pytest.raises(ConfigError, match="model.mlp"):
        upcycle(gpt2, arch_config("gpt2", "model.layout=moe"))


@pytest.mark.slow
def test_routed_kinds_compile_whole_in_a_grouped_query_swiglu_architecture():
    """Values and every gradient of blocks compiled whole (``fullgraph``: a graph break raises)
    against eager, in the architecture that changes the attention and MLP most: a MoD block
    (GQA attention, RMSNorm, SwiGLU MLP) and a staged MoDE block (SwiGLU experts). Traced by
    dynamo and AOT autograd (``aot_eager``) to keep the suite's time: with inductor the same
    test took 37 s cold on the 2-core development machine (2026-12-04, passing); inductor's
    code generation is tested on the default architecture (tests/test_compile.py)."""
    layout = ["model.layout=mod,mode_staged", "model.n_layers=2"]
    cfg = arch_config("llama_gqa", *layout, "model.qkv_bias=true", "model.mod.causal=predictor")
    torch.manual_seed(0)
    eager = MoDETransformer(cfg)
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled, fullgraph=True, backend="aot_eager")
    idx = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (eager, compiled):
        _, loss = model(idx, idx)
        (loss + aux_loss(model)).backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert_close(results[1][0], results[0][0], "layer_grad")
    for name, g in results[0][1].items():
        assert_close(results[1][1][name], g, "layer_grad", msg=name)
