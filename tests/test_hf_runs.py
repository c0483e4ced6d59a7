"""Training runs started from a published model (``--init-from hf:<dir>``): the data must be
in the model's tokenizer (checked at start, said in the first line), resumes that need no
``--init-from``, and published MoE models fine-tuned as they are. Tiny random models and
tokenizers made here, offline."""

from __future__ import annotations

import pytest

from mode.config import load_config
from mode.prepare import prepare
from mode.train import main, train
from tests.test_hf import hf_model

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

TEXT = "Now is the winter of our discontent made glorious summer by this sun of York; " * 80
RUN = ["train.steps=2", "train.eval_every=2", "train.batch_size=2", "model.seq_len=32", "train.progress=false"]
RUN += ["train.max_seconds=0", "train.eval_batches=1"]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny Llama with its own BPE tokenizer (320 ids: 300 of the BPE, the rest padding),
    the data prepared in that tokenizer, and a text file."""
    from mode.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("published")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    hf_model("llama", vocab_size=320).save_pretrained(root / "llama")
    train_bpe([root / "text.txt"], 300).save(root / "llama" / "tokenizer.json")
    prepare([str(root / "text.txt")], root / "data", tokenizer=str(root / "llama"), val_fraction=0.2)
    return root


def test_data_in_the_published_models_tokenizer_trains_and_the_first_line_says_so(published, tmp_path, capsys, caplog):
    data = f"data.source={published / 'data'}"
    cfg = load_config("dense", [*RUN, f"train.out_dir={tmp_path}", data, "train.progress=true"])
    cfg.train.init_from = f"hf:{published / 'llama'}"
    with caplog.at_level("INFO", logger="mode"):
        train(cfg)
    first = (caplog.text + capsys.readouterr().out).split(" MFU against ", 1)[1].splitlines()[0]
    assert f"tokenizer {published / 'data' / 'tokenizer.json'}, the published model's" in first


@pytest.mark.parametrize("data", ["bytes", "other"])
def test_data_in_another_tokenizer_is_refused_by_name(published, tmp_path, data):
    """The byte corpus (the default data) and a directory prepared with another BPE: both
    named at start, before any model is built, with the way to prepare the data."""
    from mode.tokenizer import train_bpe

    source = "shakespeare"
    if data == "other":
        train_bpe([published / "text.txt"], 290).save(tmp_path / "tokenizer.json")
        prepare([str(published / "text.txt")], tmp_path / "data", tokenizer=str(tmp_path / "tokenizer.json"))
        source = str(tmp_path / "data")
    run = [*RUN, f"train.out_dir={tmp_path / 'run'}", f"data.source={source}"]
    with pytest.raises(ValueError, match=r"is not the published model .*llama's .*mode-prepare .*--tokenizer"):
        main(["--config", "dense", "--init-from", f"hf:{published / 'llama'}", *run])
    assert not (tmp_path / "run" / "ckpt.pt").exists()


def test_a_run_from_a_published_model_resumes_without_init_from_or_its_directory(published, tmp_path, capsys):
    """The README's resume line (no ``--init-from``) on a run that started from a published
    model, after that model's directory is gone: the checkpoint's own config is the model."""
    import shutil

    from mode.checkpoint import checkpoint_config

    shutil.copytree(published / "llama", tmp_path / "llama")
    run = [*RUN, f"train.out_dir={tmp_path / 'run'}", f"data.source={published / 'data'}"]
    main(["--config", "dense", "--init-from", f"hf:{tmp_path / 'llama'}", *run])
    started = checkpoint_config(tmp_path / "run" / "ckpt.pt")
    shutil.rmtree(tmp_path / "llama")
    capsys.readouterr()
    main(["--config", "dense", *run, "train.resume=true", "train.steps=4", "train.progress=true"])
    resumed = checkpoint_config(tmp_path / "run" / "ckpt.pt")
    assert resumed.model == started.model and resumed.train.steps == 4
    assert resumed.train.init_from == f"hf:{tmp_path / 'llama'}"  # the run still says where it started
    assert started.model.d_model == 32 != load_config("dense").model.d_model  # the published shape
    # a model option that keeps the weights' shapes is taken from the command line, and said
    main(["--config", "dense", *run, "train.resume=true", "train.steps=5", "model.norm_eps=1e-06"])
    assert checkpoint_config(tmp_path / "run" / "ckpt.pt").model.norm_eps == 1e-06


def test_a_resume_that_asks_for_another_shape_is_named_in_one_line(published, tmp_path):
    run = [*RUN, f"train.out_dir={tmp_path}", f"data.source={published / 'data'}"]
    main(["--config", "dense", "--init-from", f"hf:{published / 'llama'}", *run])
    with pytest.raises(ValueError, match=r"model.d_model=40 \(the checkpoint's: 32\) would not load .*ckpt.pt") as e:
        main(["--config", "dense", *run, "train.resume=true", "model.d_model=40"])
    assert "\n" not in str(e.value)


def _declare_eos(directory, token: str, token_id: int | None = None) -> None:
    """Declare ``token`` the end of text in a directory's tokenizer_config.json (and, for a
    published model's directory, its config.json and generation_config.json)."""
    import json

    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": token})
    )
    if token_id is not None:
        (directory / "special_tokens_map.json").write_text(json.dumps({"eos_token": token}))
        for name in ("config.json", "generation_config.json"):
            fields = json.loads((directory / name).read_text()) if (directory / name).exists() else {}
            (directory / name).write_text(json.dumps({**fields, "eos_token_id": token_id, "bos_token_id": None}))


def test_an_export_carries_its_tokenizer_and_generate_stops_at_end_of_text(published, tmp_path):
    """HF -> mode -> HF: the export holds every file of the published model that describes
    tokens, byte for byte; ``AutoTokenizer`` loads it, and transformers' greedy ``generate``
    stops at the declared end of text with the tokens ``mode-generate`` gives."""
    import shutil

    import torch
    import transformers

    from mode.eval import main_generate
    from mode.hf import main as export
    from mode.model import MoDETransformer
    from mode.tokenizer import load_tokenizer

    shutil.copytree(published / "llama", tmp_path / "llama")
    shutil.copytree(published / "data", tmp_path / "data")
    run = [*RUN, f"train.out_dir={tmp_path / 'run'}", f"data.source={tmp_path / 'data'}"]
    main(["--config", "dense", "--init-from", f"hf:{tmp_path / 'llama'}", *run])
    ckpt = tmp_path / "run" / "ckpt.pt"
    ours = MoDETransformer.from_checkpoint(ckpt)
    tok = load_tokenizer(tmp_path / "data")
    prompt = torch.tensor(tok.encode("Now is the winter"))[None]
    free = ours.generate(prompt, 8, temperature=0.0)[0, prompt.shape[1] :].tolist()
    # the end of text: a token it emits once, late, whose text is not in the prompt (a declared
    # special token's text is one token wherever it appears)
    stop = next(
        i for i in range(2, 8) if free[i] not in free[:i] and tok.decode([free[i]]).strip() not in "Now is the winter"
    )
    eos = free[stop]
    _declare_eos(tmp_path / "data", tok.tokenizer.id_to_token(eos))
    _declare_eos(tmp_path / "llama", tok.tokenizer.id_to_token(eos), eos)

    export([str(ckpt), str(tmp_path / "out")])
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "llama" / name).read_bytes(), name
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert theirs("Now is the winter", add_special_tokens=False)["input_ids"] == prompt[0].tolist()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.config.eos_token_id == eos
    with torch.no_grad():
        out = back.generate(prompt, max_new_tokens=8, do_sample=False)[0, prompt.shape[1] :].tolist()
    assert out == free[: stop + 1]  # stopped at end of text
    said = main_generate([str(tmp_path / "out"), "--prompt", "Now is the winter", "--temperature", "0"])
    assert said == tok.decode(prompt[0].tolist() + out)


def test_a_byte_model_exports_a_tokenizer_of_bytes(tmp_path):
    """A run on bytes: the export's tokenizer gives the bytes' values, non-ASCII text too, and
    no end-of-text id stands in (transformers' class defaults are overridden with null)."""
    import transformers

    from mode.eval import main_generate
    from mode.hf import main as export

    train(load_config("dense", [*RUN, f"train.out_dir={tmp_path / 'run'}", "model.d_model=32", "model.n_heads=2"]))
    export([str(tmp_path / "run" / "ckpt.pt"), str(tmp_path / "out")])
    text = "Grüße, 東京!\n"
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert theirs(text, add_special_tokens=False)["input_ids"] == list(text.encode("utf-8"))
    assert theirs.decode(list(text.encode("utf-8"))) == text
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out", trust_remote_code=True).eos_token_id is None
    assert main_generate([str(tmp_path / "out"), "--prompt", "ROMEO:", "--max-new-tokens", "4"]).startswith("ROMEO:")


def test_a_reexported_moe_model_names_no_end_of_text_outside_its_vocabulary(tmp_path):
    """OLMoE's transformers default eos id (50279) is outside a 512-id vocabulary: an export
    with no tokenizer writes null, and one given the source directory keeps the source's ids."""
    import transformers

    from mode.hf import from_hf, to_hf

    hf_model("olmoe").save_pretrained(tmp_path / "olmoe")
    out = to_hf(from_hf(tmp_path / "olmoe"), tmp_path / "out")
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.eos_token_id is None and config.vocab_size < 50279


MOE_FAMILIES = ["mixtral", "olmoe", "qwen2_moe"]
# settings at which the target computes the published model's function exactly
AS_PUBLISHED = {
    "moe": [],  # the published MoE blocks as they are
    "mode_staged": ["model.mod.capacity=1.0", "model.mod.gate=none"],  # MoD routing every token, unit gate
}


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("preset", list(AS_PUBLISHED))
def test_a_published_moe_model_starts_a_moe_or_staged_run_with_its_own_logits(family, preset, tmp_path):
    """A published MoE model into ``moe`` (as it is: its experts, router, shared expert and
    dense layers) or ``mode_staged`` (MoD routing around each of its MoE blocks): at the
    identity settings the model computes the published logits."""
    from mode.convert import upcycle
    from tests.test_hf import logits

    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    model = upcycle(f"hf:{tmp_path}", load_config(preset, AS_PUBLISHED[preset])).eval()
    kinds, published = model.cfg.block_kinds(), hf.config.num_hidden_layers
    assert len(kinds) == published
    if preset == "mode_staged":  # the preset routes every other block: those MoE blocks are wrapped
        assert kinds[1] in ("mode_staged", "mod") and kinds[0] in ("moe", "dense")
    from tests.tolerances import assert_close

    assert_close(logits(model), logits(hf), "model")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_published_moe_model_into_integrated_mode_keeps_its_experts_and_router_rows(family, tmp_path):
    """No identity setting exists (no-op experts take a share): the real experts and their
    router rows are the published ones; the no-op experts are added."""
    import torch

    from mode.convert import upcycle
    from mode.hf import from_hf
    from tests.test_hf import logits

    hf_model(family).save_pretrained(tmp_path)
    published = from_hf(tmp_path)
    model = upcycle(f"hf:{tmp_path}", load_config("mode_integrated")).eval()
    i = next(i for i, k in enumerate(model.cfg.block_kinds()) if k == "mode_integrated")
    ours, theirs = model.blocks[i].mlp, published.blocks[i].mlp
    assert ours.n_noop == 8 and ours.n_experts == theirs.n_experts
    assert torch.equal(ours.experts.w1, theirs.experts.w1) and torch.equal(ours.experts.w2, theirs.experts.w2)
    assert torch.equal(ours.router.weight[: theirs.n_experts], theirs.router.weight)
    assert torch.isfinite(logits(model)).all()


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_mode_train_fine_tunes_a_published_moe_model_from_the_command_line(family, tmp_path):
    """``mode-train --init-from hf:<MoE dir>`` into ``moe`` and ``mode_staged``: trains,
    saves, and the moe run exports back to its family (transformers computes its logits)."""
    import torch
    import transformers

    from mode.hf import to_hf
    from mode.model import MoDETransformer
    from tests.test_hf import logits
    from tests.tolerances import assert_close

    hf_model(family, vocab_size=256).save_pretrained(tmp_path / "hf")  # the byte corpus: 256 ids
    for preset in ("moe", "mode_staged"):
        run = [*RUN, f"train.out_dir={tmp_path / preset}"]
        main(["--config", preset, "--init-from", f"hf:{tmp_path / 'hf'}", *run])
    model = MoDETransformer.from_checkpoint(tmp_path / "moe" / "ckpt.pt")
    back = transformers.AutoModelForCausalLM.from_pretrained(to_hf(model, tmp_path / "out")).eval()
    idx = torch.randint(0, 256, (2, 16))
    assert_close(logits(back, idx), logits(model, idx), "model")
    staged = MoDETransformer.from_checkpoint(tmp_path / "mode_staged" / "ckpt.pt")
    assert "mode_staged" in staged.cfg.block_kinds()


def test_token_ids_past_the_published_vocabulary_are_named_with_the_data(published, tmp_path):
    """Token files (no tokenizer known) whose ids need more than the published model's 320:
    refused at start, naming the data and the sizes, not at the first forward."""
    import numpy as np

    ids = np.random.default_rng(0).integers(0, 400, 5000).astype(np.uint16)
    ids.tofile(tmp_path / "tokens.bin")
    run = [*RUN, f"train.out_dir={tmp_path / 'run'}", f"data.source={tmp_path / 'tokens.bin'}"]
    with pytest.raises(ValueError, match=r"model.vocab_size=320 is too small: the ids of data.source=.*tokens.bin"):
        main(["--config", "dense", "--init-from", f"hf:{published / 'llama'}", *run])
