"""Optional GPU backends we cannot run here: MegaBlocks' grouped GEMM and xformers attention.
Their argument preparation and error paths are tested on CPU; the CUDA tests run on a GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mode.config import load_config
from mode.experts.grouped_gemm import gmm_loop, gmm_megablocks, megablocks_arguments
from mode.layers.attention import CausalSelfAttention, attention_unavailable_reason
from tests.tolerances import assert_close


def grouped_gemm_ops_gmm_standin(a, b, batch_sizes, trans_b=False):
    """Stand-in for ``grouped_gemm.ops.gmm`` (MegaBlocks' kernel package, CUDA only): the same
    signature and the argument checks its kernel makes (csrc/grouped_gemm.cu, ``GroupedGemm``),
    except that tensors live on the CPU; computed by the ``loop`` reference."""
    assert batch_sizes.device.type == "cpu" and batch_sizes.dtype == torch.int64 and batch_sizes.dim() == 1
    assert a.dim() == 2 and b.dim() == 3 and not trans_b
    assert a.dtype == b.dtype == torch.bfloat16
    assert a.is_contiguous() and b.is_contiguous()
    assert b.shape[1] == a.shape[1] and batch_sizes.shape[0] == b.shape[0]
    assert int(batch_sizes.sum()) == a.shape[0]
    return gmm_loop(a, b, batch_sizes)


def test_megablocks_adapter_prepares_what_grouped_gemm_checks():
    counts = torch.tensor([3, 0, 5, 2], dtype=torch.int32)
    x = torch.randn(16, 10).bfloat16().t()  # [10, 16], not contiguous
    w = torch.randn(4, 24, 16).bfloat16().transpose(1, 2)  # [E, K, M], not contiguous
    assert not x.is_contiguous() and not w.is_contiguous()
    xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = gmm_megablocks(xs, ws, counts, gmm=grouped_gemm_ops_gmm_standin)
    ref = gmm_loop(xr, wr, counts)
    assert_close(out, ref, "exact")
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    assert_close(xs.grad, xr.grad, "exact")
    assert_close(ws.grad, wr.grad, "exact")
    with pytest.raises(ValueError, match="counts"):
        megablocks_arguments(x, w, counts[:3])


def test_attention_backend_is_validated_and_explains_what_is_missing():
    with pytest.raises(ValueError, match="model.attention"):
        load_config(None, ["model.attention=flash"])
    attn = CausalSelfAttention(16, 2)
    with pytest.raises(ValueError, match="sdpa"):
        attn.set_backend("flash")
    if importlib.util.find_spec("xformers") is None:
        with pytest.raises(RuntimeError, match="pip install xformers"):
            attn.set_backend("xformers")
    else:
        attn.set_backend("xformers")
        with pytest.raises(RuntimeError, match="CUDA"):
            attn(torch.randn(1, 4, 16))
    assert attention_unavailable_reason("sdpa", "cpu") is None


@pytest.mark.cuda
def test_xformers_attention_equals_sdpa_over_chosen_tokens():
    if attention_unavailable_reason("xformers", "cuda"):
        pytest.skip(attention_unavailable_reason("xformers", "cuda"))
    attn = CausalSelfAttention(256, 4).cuda()
    x = torch.randn(3, 50, 256, device="cuda")
    positions = torch.sort(torch.randperm(400, device="cuda")[:50]).values.expand(3, 50)  # chosen, ascending
    ref = attn.attend(x, positions)[0]
    attn.set_backend("xformers")
    assert_close(attn.attend(x, positions)[0], ref, "attention_kernel")


@pytest.mark.cuda
def test_megablocks_adapter_on_the_gpu_equals_loop():
    if importlib.util.find_spec("grouped_gemm") is None:
        pytest.skip("MegaBlocks' grouped_gemm is not installed: pip install 'mode-moe[gpu]'")
    counts = torch.tensor([300, 0, 129, 64])
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16) / 16
    assert_close(gmm_megablocks(x, w, counts), gmm_loop(x, w, counts), "reduction")
