import pytest

from mode.config import Config, load_config, preset_names, to_yaml

ERROR_CASES = [
    ("model.mod.capacity=1.5", "model.mod.capacity"),
    ("model.mod.capacity=-0.1", "model.mod.capacity"),
    ("model.moe.top_k=9", "model.moe.top_k"),
    ("model.moe.capacity_factor=0", "model.moe.capacity_factor"),
    ("model.moe.backend=cuda_magic", "model.moe.backend"),
    ("model.layout=dense,foo", "model.layout"),
    ("model.n_layers=3", "model.layout"),
    ("model.n_heads=5", "model.d_model"),
    ("model.n_layers=abc", "model.n_layers"),
    ("model.no_such_field=1", "no_such_field"),
    ("train.min_lr=1.0", "train.min_lr"),
]


@pytest.mark.parametrize("override,field", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_invalid_values_name_the_field(override, field):
    with pytest.raises(ValueError, match=field):
        load_config(None, [override])


@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_round_trips(preset, tmp_path):
    cfg = load_config(preset)
    assert isinstance(cfg, Config)
    path = tmp_path / "cfg.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


def test_overrides_merge_over_preset():
    cfg = load_config("mod", ["model.n_layers=8", "model.mod.capacity=0.25"])
    assert cfg.model.n_layers == 8 and cfg.model.mod.capacity == 0.25
    assert cfg.model.block_kinds() == ["dense", "mod"] * 4


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(FileNotFoundError, match="dense"):
        load_config("no_such_preset")


def test_ep_size_must_divide_the_experts_only_where_there_are_experts():
    with pytest.raises(ValueError, match="parallel.ep_size"):
        load_config("moe", ["parallel.ep_size=3"])
    # dense layouts have no experts to split: ep ranks are data parallel, n_experts unused
    assert load_config("dense", ["parallel.ep_size=3"]).parallel.ep_size == 3


def test_an_override_without_a_value_is_refused_and_a_preset_name_is_pointed_to_config():
    with pytest.raises(ValueError, match=r"override 'mod' has no '='.*is a preset.*--config mod"):
        load_config("dense", ["mod"])
    with pytest.raises(ValueError, match=r"override 'model.n_layers' has no '='") as err:
        load_config("dense", ["model.n_layers"])
    assert "preset" not in str(err.value)
