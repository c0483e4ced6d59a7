"""The README's smallest example runs as written, and the documents it links exist."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mode.checkpoint import checkpoint_config, load_checkpoint
from mode.model import MoDETransformer
from tests.tolerances import assert_close

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_smallest_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "README.md", "exec"), {})  # noqa: S102


def test_every_linked_document_exists():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_the_hugging_face_commands_run_at_tiny_size(tmp_path, family):
    """The README's "From and to Hugging Face" commands, on a tiny random dense (Llama) and MoE
    (Mixtral) model and a few steps; transformers then computes the exported model's logits."""
    transformers = pytest.importorskip("transformers")
    from tests.test_hf import hf_model

    section = README.split("## From and to Hugging Face", 1)[1]
    commands = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[0]
    from mode.data import prepare_shakespeare
    from mode.tokenizer import train_bpe

    hf_model(family, vocab_size=320).save_pretrained(tmp_path / "llama")  # its tokenizer: 300 ids + padding
    (tmp_path / "text.txt").write_bytes(prepare_shakespeare("data").read_bytes()[:100_000])
    train_bpe([tmp_path / "text.txt"], 300).save(tmp_path / "llama" / "tokenizer.json")
    tiny = "model.seq_len=32 train.steps=2 train.eval_every=2 train.eval_batches=1 train.batch_size=2"
    tiny += " train.progress=false train.max_seconds=0"
    script = commands.replace("path/to/llama", str(tmp_path / "llama")).replace("runs/", f"{tmp_path}/runs/")
    script = script.replace("data/hf", f"{tmp_path}/data/hf")
    script = script.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    extra = {"mode-train": f" {tiny}", "mode-eval": " --max-batches 2"}
    script = "\n".join(
        line.split("#")[0] + next((v for k, v in extra.items() if k in line), "") for line in script.splitlines()
    )
    done = subprocess.run(["bash", "-euc", script], cwd=ROOT, check=True, capture_output=True, text=True)
    assert "causal routing: loss" in done.stdout  # mode-eval of the staged MoDE run
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "moe_hf").eval()
    model = MoDETransformer(checkpoint_config(tmp_path / "runs" / "moe" / "ckpt.pt").model)
    load_checkpoint(tmp_path / "runs" / "moe" / "ckpt.pt", model)
    idx = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        assert_close(back(idx).logits, model.eval()(idx)[0], "model")
    staged = MoDETransformer.from_checkpoint(tmp_path / "runs" / "staged" / "ckpt.pt")
    remote = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "staged_hf", trust_remote_code=True)
    with torch.no_grad():
        # the export routes as every tool does by default (causal for this preset)
        assert_close(remote.eval()(idx).logits, staged(idx, routing=staged.default_routing())[0], "exact")
