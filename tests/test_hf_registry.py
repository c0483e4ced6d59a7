"""The Hugging Face family table (``mode.hf.registry``): every family it lists is one the
round-trip tests build with transformers, and a new family is one adapter and one row."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mode.hf import FAMILIES, config_from_hf, from_hf, hf_family, to_hf
from mode.hf.llama import LLAMA
from mode.hf.registry import WRITTEN
from mode.model import MoDETransformer
from tests import test_hf

pytest.importorskip("safetensors")


def test_the_round_trip_tests_cover_every_registered_family():
    assert set(test_hf.FAMILIES) == set(FAMILIES)
    for name, family in FAMILIES.items():
        assert family.name == name
        if family.architecture is not None:  # the class an export names is the one the tests load
            assert test_hf.FAMILIES[name][1] == family.architecture


@pytest.mark.parametrize("name", WRITTEN)
def test_each_written_family_holds_the_models_it_reads(name):
    """A model read from a family's config exports to that same family (Mistral, read only, as Llama)."""
    import transformers

    config_cls, _, kwargs = test_hf.FAMILIES[name]
    cfg = config_from_hf(getattr(transformers, config_cls)(**kwargs).to_dict())
    assert hf_family(cfg) == name


def test_a_family_added_as_one_row_is_read_and_written(tmp_path, monkeypatch):
    """An adapter registered under a new ``model_type`` reads a checkpoint of it and writes it:
    the conversion asks the table, nothing else names the family."""
    clone = dataclasses.replace(LLAMA, name="llama_clone")
    monkeypatch.setitem(FAMILIES, "llama_clone", clone)
    monkeypatch.setattr("mode.hf.checkpoint.WRITTEN", ("llama_clone", *WRITTEN))
    cfg = config_from_hf({**test_hf.LLAMA, "model_type": "llama_clone"})
    torch.manual_seed(0)
    model = MoDETransformer(cfg).eval()
    out = to_hf(model, tmp_path / "clone", native=True)
    assert (out / "config.json").read_text().count('"llama_clone"') == 1
    back = from_hf(out)
    x = torch.randint(0, cfg.vocab_size, (1, 8))
    with torch.no_grad():
        assert torch.equal(back(x)[0], model(x)[0])
