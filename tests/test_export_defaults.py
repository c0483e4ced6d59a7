"""One routing default: ``mode-export``, ``mode-generate`` and the lm-eval model route a model
the same way unless told (causal where it can decide per token), so transformers' greedy
tokens from a default export are ``mode-generate``'s."""

import pytest
import torch

from mode.config import load_config
from mode.eval import main_generate
from mode.hf import hf_config
from mode.hf import main as export_main
from mode.model import MoDETransformer
from mode.tokenizer import load_tokenizer
from mode.train import train
from tests.tiny import TINY

pytestmark = pytest.mark.slow


def test_a_default_export_generates_the_tokens_mode_generate_gives(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    cfg = load_config("mod", [*TINY, "model.mod.causal=predictor", f"train.out_dir={tmp_path / 'run'}"])
    train(cfg)
    ckpt = tmp_path / "run" / "ckpt.pt"
    export_main([str(ckpt), str(tmp_path / "hf")])
    assert "causal routing" in capsys.readouterr().out
    assert hf_config(tmp_path / "hf")["routing"] == "causal"
    ours = main_generate([str(ckpt), "--prompt", "KING", "--max-new-tokens", "12", "--temperature", "0"])
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    prompt = torch.tensor([list(b"KING")])
    with torch.no_grad():
        out = back.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False, pad_token_id=0
        )
    assert load_tokenizer("bytes").decode_text(out[0].tolist()) == ours


ROUTINGS = [("mode_staged", "causal"), ("mod_random", "topk"), ("moe_capacity", "topk")]


@pytest.mark.parametrize("preset,routing", ROUTINGS)
def test_an_export_routes_causally_where_the_model_can(preset, routing, tmp_path):
    """Causal where every routed layer decides per token; top-k (as trained) where one cannot
    (random routing, capacity-dropping experts), with no error."""
    from mode.hf import to_hf

    extra = ["model.mod.causal=predictor"] if preset == "mode_staged" else []
    out = to_hf(MoDETransformer(load_config(preset, [*TINY, *extra]).model), tmp_path / "hf", native=False)
    assert hf_config(out)["routing"] == routing
