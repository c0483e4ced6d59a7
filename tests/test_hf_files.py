"""A Hugging Face directory's files pick no paths and leave no ambiguity: an export into a
directory holding an older sharded model removes that model's index and shards (transformers
and ``from_hf`` then load the same, new weights), a directory holding both an index and a
single file is refused, and an index naming a shard outside its directory is refused."""

import json

import pytest
import torch

from mode.hf import UnsupportedCheckpoint, from_hf, to_hf
from tests.test_hf import IDX, hf_model, logits
from tests.tolerances import assert_close

pytest.importorskip("transformers")


def test_export_over_an_older_sharded_model_removes_it(tmp_path):
    old = hf_model("llama", seed=1)
    old.save_pretrained(tmp_path, max_shard_size="20KB")
    old_shards = list(tmp_path.glob("model-*.safetensors"))
    assert old_shards and (tmp_path / "model.safetensors.index.json").is_file()
    new = from_hf(tmp_path)
    with torch.no_grad():
        new.tok_emb.weight.mul_(-1)  # a different model in the same shape
    to_hf(new, tmp_path)
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert not any(p.exists() for p in old_shards)
    assert torch.equal(logits(from_hf(tmp_path)), logits(new))

    import transformers

    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert_close(theirs(IDX).logits, logits(new), "model")


def test_an_index_beside_a_single_file_is_refused(tmp_path):
    hf_model("llama").save_pretrained(tmp_path, max_shard_size="20KB")
    other = tmp_path / "other"
    hf_model("llama", seed=2).save_pretrained(other)
    (other / "model.safetensors").rename(tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedCheckpoint, match="both model.safetensors and model.safetensors.index.json"):
        from_hf(tmp_path)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors"])
def test_an_index_naming_a_path_outside_is_refused(tmp_path, shard):
    hf_model("llama").save_pretrained(tmp_path, max_shard_size="20KB")
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = shard
    index.write_text(json.dumps(data))
    with pytest.raises(UnsupportedCheckpoint, match="only file names inside its directory"):
        from_hf(tmp_path)


def test_an_index_without_a_weight_map_is_named(tmp_path):
    hf_model("llama").save_pretrained(tmp_path, max_shard_size="20KB")
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(UnsupportedCheckpoint, match="no weight_map"):
        from_hf(tmp_path)
