"""Evaluating and sampling trained models: ``MoDETransformer.from_checkpoint``, ``mode-eval``
(the whole validation split, top-k and causal routing) and ``mode-generate`` (top-p, end of
text), on real checkpoints trained here."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mode.config import load_config
from mode.data import load_corpus
from mode.eval import main_eval, main_generate
from mode.model import MoDETransformer, sample_next
from mode.train import train
from tests.tiny import TINY
from tests.tolerances import assert_close


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny MoD model with a causal predictor, trained 3 steps on 40 kB of the byte corpus
    (its validation split: 2 kB, 62 windows)."""
    from mode.data import prepare_shakespeare

    out = tmp_path_factory.mktemp("run")
    text = out / "text.txt"
    text.write_bytes(prepare_shakespeare("data").read_bytes()[:40_000])
    overrides = ["model.mod.causal=predictor", "train.steps=3", f"train.out_dir={out}", f"data.source={text}"]
    cfg = load_config("mod", [*TINY, *overrides])
    model, _ = train(cfg)
    return model.eval(), out / "ckpt.pt", cfg


def test_from_checkpoint_is_the_trained_model(trained):
    model, ckpt, _ = trained
    loaded = MoDETransformer.from_checkpoint(ckpt)
    idx = torch.randint(0, 256, (2, 32))
    assert not loaded.training
    assert_close(loaded(idx)[0], model(idx)[0], "exact")


def test_mode_eval_reads_the_whole_validation_split_in_both_routings(trained, tmp_path):
    model, ckpt, cfg = trained
    results = main_eval([str(ckpt), "--batch-size", "3", "--json", str(tmp_path / "eval.json")])
    assert json.loads((tmp_path / "eval.json").read_text())["topk"]["loss"] == results["topk"]["loss"]
    val = load_corpus(cfg.data.source, cfg.model.seq_len, cfg.data.val_fraction, cfg.data.cache_dir).val.tokens
    T = cfg.model.seq_len
    windows = (len(val) - 1) // T
    for routing in ("topk", "causal"):
        # the reference: every window alone, the mean over all predicted tokens
        losses = []
        with torch.no_grad():
            for w in range(windows):
                xy = torch.from_numpy(np.asarray(val[w * T : w * T + T + 1], dtype=np.int64))[None]
                logits, _ = model(xy[:, :-1], routing=routing)
                losses.append(F.cross_entropy(logits[0], xy[0, 1:], reduction="sum"))
        row = results[routing]
        assert row["tokens"] == windows * T
        assert row["loss"] == pytest.approx(float(torch.stack(losses).sum()) / (windows * T), rel=1e-5)
        assert row["bits_per_byte"] == pytest.approx(row["loss"] / math.log(2))  # bytes: one per token
        share = "routed_share" if routing == "topk" else "causal_share"
        assert any(k.endswith(share) for k in row["metrics"]), row["metrics"]


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    torch.manual_seed(0)
    draws = torch.cat([sample_next(logits, 1.0, top_p=0.7) for _ in range(400)]).flatten()
    assert set(draws.tolist()) == {0, 1}  # 0.5 alone does not reach 0.7; with 0.3 it does
    assert (draws == 0).float().mean() == pytest.approx(0.5 / 0.8, abs=0.08)
    assert set(torch.cat([sample_next(logits, 1.0, top_p=0.4) for _ in range(50)]).flatten().tolist()) == {0}
    with pytest.raises(ValueError, match="top_p"):
        MoDETransformer(load_config(None, TINY).model).generate(torch.zeros(1, 2, dtype=torch.long), 2, top_p=1.5)


def test_generation_stops_at_the_end_of_text_id(trained):
    model, _, _ = trained
    prompt = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(1))
    free = model.generate(prompt, 6, temperature=0.0)
    first = int(free[0, 4])
    assert model.generate(prompt, 6, temperature=0.0, eos_id=first).shape[1] == 5
    assert torch.equal(model.generate(prompt, 6, temperature=0.0, eos_id=-1), free)  # an id never produced


def test_mode_generate_decodes_with_the_models_tokenizer(trained, capsys):
    _, ckpt, _ = trained
    text = main_generate([str(ckpt), "--prompt", "ROMEO:", "--max-new-tokens", "20", "--top-p", "0.9"])
    assert text.startswith("ROMEO:") and len(text.encode()) >= len("ROMEO:")
    assert text in capsys.readouterr().out


def test_mode_generate_reads_escapes_a_prompt_file_and_stdin(trained, tmp_path, monkeypatch):
    _, ckpt, _ = trained
    greedy = ["--max-new-tokens", "4", "--temperature", "0"]
    typed = main_generate([str(ckpt), "--prompt", r"KING:\nWho\tgoes", *greedy])  # as a shell passes it
    assert typed.startswith("KING:\nWho\tgoes")
    assert main_generate([str(ckpt), "--prompt", r"a\\n", *greedy]).startswith("a\\n")  # an escaped backslash
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("ROMÉO:\nquoi", encoding="utf-8")  # non-ASCII: its UTF-8 bytes are the prompt
    from_file = main_generate([str(ckpt), "--prompt-file", str(prompt), *greedy])
    assert from_file.startswith("ROMÉO:\nquoi")
    monkeypatch.setattr("sys.stdin", io.StringIO("ROMÉO:\nquoi"))
    assert main_generate([str(ckpt), "--prompt-file", "-", *greedy]) == from_file
    prompt.write_bytes(b"\xff\xfe bad")
    with pytest.raises(ValueError, match="not UTF-8"):
        main_generate([str(ckpt), "--prompt-file", str(prompt), *greedy])


def test_mode_eval_on_a_hugging_face_directory_with_data(tmp_path):
    pytest.importorskip("transformers")
    from tests.test_hf import hf_model

    hf_model("llama", vocab_size=256).save_pretrained(tmp_path / "llama")
    text = tmp_path / "text.txt"
    text.write_text("to be or not to be " * 2000)
    results = main_eval([str(tmp_path / "llama"), "--data", str(text), "--max-batches", "2"])
    assert results["topk"]["tokens"] == 2 * 8 * 64 and "causal" in results  # a dense model decides per token


def test_mode_eval_says_which_share_it_scores_and_whole_scores_every_byte(trained, capsys):
    """A text's validation split is its last 5% (said, with the share); ``--whole`` scores
    every window of the file: the file's bytes, counted here, are its tokens."""
    model, ckpt, cfg = trained
    size, T = len(open(cfg.data.source, "rb").read()), cfg.model.seq_len
    part = main_eval([str(ckpt), "--max-batches", "1"])
    said = capsys.readouterr().out
    n_val = max(T + 2, int(size * cfg.data.val_fraction))
    assert f"the validation split, {n_val} of {size} ids ({n_val / size:.1%}, the last ones)" in said
    whole = main_eval([str(ckpt), "--whole", "--batch-size", "64"])
    assert f"every token, {size} ids" in capsys.readouterr().out
    assert whole["split"] == "whole" and part["split"] == "val"
    assert whole["topk"]["tokens"] == (size - 1) // T * T
    # bytes: one byte per token, so bits per byte is bits per token, over the whole file too
    assert whole["topk"]["bits_per_byte"] == pytest.approx(whole["topk"]["bits_per_token"])


def test_mode_eval_refuses_a_tokenizer_that_is_not_the_models(trained, tmp_path):
    pytest.importorskip("tokenizers")
    from mode.tokenizer import train_bpe

    model, ckpt, cfg = trained
    train_bpe([cfg.data.source], 300).save(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match=r"tokenizer .*tokenizer.json is not the model .*'s \(bytes\): 300 vs 256"):
        main_eval([str(ckpt), "--tokenizer", str(tmp_path / "tokenizer.json")])
    assert main_eval([str(ckpt), "--tokenizer", "bytes", "--max-batches", "1"])["tokenizer"] == "bytes"
