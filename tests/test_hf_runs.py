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
