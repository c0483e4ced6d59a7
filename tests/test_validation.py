"""Every bad input at a public entry point gets one ValueError/TypeError naming the argument,
the bad value and the fix, raised before any computation. One row per case."""

import fractions
import json

import numpy as np
import pytest
import torch

import mode
import mode.train
from mode import checkpoint
from mode.checkpoint import FORMAT_VERSION, CheckpointError
from mode.config import load_config
from mode.data import load_corpus, load_splits
from mode.hf import UnsupportedCheckpoint, from_hf
from mode.model import MoDETransformer

D = 16


def lm(*extra: str) -> MoDETransformer:
    torch.manual_seed(0)
    cfg = load_config(None, ["model.d_model=16", "model.n_heads=2", "model.n_layers=2", "model.seq_len=32", *extra])
    return MoDETransformer(cfg.model)


def ids(*shape: int, dtype=torch.long, value: int | None = None) -> torch.Tensor:
    x = torch.randint(0, 256, shape)
    if value is not None:
        x[..., -1] = value
    return x.to(dtype)


def data_file(tmp_path, n_bytes: int) -> str:
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"a" * n_bytes)
    return str(path)


# (id, callable taking tmp_path, exception type, words the message must contain)
CASES = [
    # layers: constructor arguments
    ("mod-capacity-str", lambda t: mode.MoDBlock(D, 2, capacity="0.5"), ValueError, "capacity='0.5'"),
    ("mod-capacity-range", lambda t: mode.MoDBlock(D, 2, capacity=1.5), ValueError, "capacity=1.5"),
    ("mod-gate-typo", lambda t: mode.MoDBlock(D, 2, gate="sigmod"), ValueError, "did you mean 'sigmoid'"),
    ("mod-causal-typo", lambda t: mode.MoDBlock(D, 2, causal="predicter"), ValueError, "did you mean 'predictor'"),
    ("moe-top-k", lambda t: mode.DroplessMoE(D, 32, 4, top_k=5), ValueError, "top_k=5"),
    ("moe-backend-typo", lambda t: mode.DroplessMoE(D, 32, 4, backend="chunkd"), ValueError, "did you mean 'chunked'"),
    ("moe-mlp", lambda t: mode.DroplessMoE(D, 32, 4, mlp="relu"), ValueError, "mlp='relu'"),
    ("moe-n-experts", lambda t: mode.DroplessMoE(D, 32, 0), ValueError, "n_experts=0"),
    ("moe-d-ff-float", lambda t: mode.DroplessMoE(D, 32.0, 4), ValueError, "d_ff=32.0"),
    ("capacity-cf", lambda t: mode.CapacityMoE(D, 32, 4, capacity_factor=0), ValueError, "capacity_factor=0"),
    ("capacity-policy", lambda t: mode.CapacityMoE(D, 32, 4, drop_policy="random"), ValueError, "drop_policy"),
    ("integrated-noop", lambda t: mode.IntegratedMoDEBlock(D, 2, n_noop=-1), ValueError, "n_noop=-1"),
    ("expert-choice-noop", lambda t: mode.ExpertChoiceMoE(D, 32, 4, n_noop=2), ValueError, "n_noop=2"),
    # layers: inputs
    ("mod-input-rank", lambda t: mode.MoDBlock(D, 2)(torch.randn(8, D)), ValueError, "[batch, seq, d_model]"),
    ("mod-input-d-model", lambda t: mode.MoDBlock(D, 2)(torch.randn(1, 8, D + 1)), ValueError, "d_model=16"),
    ("mod-input-ids", lambda t: mode.MoDBlock(D, 2)(torch.ones(1, 8, D, dtype=torch.long)), TypeError, "floating"),
    ("dense-input-d-model", lambda t: mode.DenseBlock(D, 2)(torch.randn(1, 8, 8)), ValueError, "d_model=16"),
    ("moe-input-d-model", lambda t: mode.DroplessMoE(D, 32, 4)(torch.randn(8, 3)), ValueError, "d_model=16"),
    ("staged-input-rank", lambda t: mode.StagedMoDEBlock(D, 2, n_experts=4)(torch.randn(D)), ValueError, "shape"),
    ("block-routing", lambda t: mode.DenseBlock(D, 2)(torch.randn(1, 4, D), routing="all"), ValueError, "routing"),
    # the LM
    ("lm-float-ids", lambda t: lm()(ids(2, 8, dtype=torch.float32)), TypeError, "integer token ids"),
    ("lm-negative-id", lambda t: lm()(ids(2, 8, value=-3)), ValueError, "token id -3"),
    ("lm-id-past-vocab", lambda t: lm()(ids(2, 8, value=256)), ValueError, "vocab_size=256"),
    ("lm-empty-batch", lambda t: lm()(ids(0, 8)), ValueError, "non-empty"),
    ("lm-empty-sequence", lambda t: lm()(ids(2, 0)), ValueError, "non-empty"),
    ("lm-1d-ids", lambda t: lm()(ids(8)), ValueError, "[batch, seq]"),
    ("lm-targets-shape", lambda t: lm()(ids(2, 8), ids(2, 7)), ValueError, "targets"),
    ("lm-routing", lambda t: lm()(ids(2, 8), routing="sideways"), ValueError, "routing='sideways'"),
    ("generate-temperature", lambda t: lm().generate(ids(1, 4), 2, temperature=-1.0), ValueError, "temperature"),
    ("generate-top-k", lambda t: lm().generate(ids(1, 4), 2, top_k=0), ValueError, "top_k=0"),
    ("generate-negative-n", lambda t: lm().generate(ids(1, 4), -1), ValueError, "max_new_tokens=-1"),
    (
        "generate-past-positions",
        lambda t: lm("model.layout=dense").generate(ids(1, 30), 8, use_cache=True),
        ValueError,
        "seq_len=32",
    ),
    # configs and the CLI
    ("config-unknown-preset", lambda t: load_config("mdo"), ValueError, "did you mean"),
    ("config-unknown-key", lambda t: load_config(None, ["model.n_layer=3"]), ValueError, "n_layers"),
    ("config-unknown-section", lambda t: load_config(None, ["trian.steps=3"]), ValueError, "train"),
    ("config-layout-typo", lambda t: load_config(None, ["model.layout=dense,mdo"]), ValueError, "did you mean 'mod'"),
    ("config-backend", lambda t: load_config(None, ["model.moe.backend=cuda"]), ValueError, "model.moe.backend"),
    ("config-noop-without-integrated", lambda t: load_config(None, ["model.moe.n_noop=4"]), ValueError, "n_noop"),
    ("config-ep-divides-experts", lambda t: load_config("moe", ["parallel.ep_size=3"]), ValueError, "ep_size"),
    ("config-capacity-str", lambda t: load_config(None, ["model.mod.capacity=half"]), ValueError, "capacity"),
    ("cli-unknown-preset", lambda t: mode.train.main(["--config", "mdo"]), ValueError, "no config 'mdo'"),
    # data
    ("data-empty-file", lambda t: load_splits(data_file(t, 0), 32), ValueError, "is empty"),
    ("data-too-short", lambda t: load_splits(data_file(t, 40), 32), ValueError, "too short for model.seq_len=32"),
    ("data-missing", lambda t: load_splits(str(t / "nope.txt"), 32), FileNotFoundError, "no such file"),
    ("data-odd-length-u16", lambda t: load_splits(token_file(t, b"\x01" * 301, ".bin"), 32), ValueError, "301 bytes"),
    ("data-odd-length-u32", lambda t: load_splits(token_file(t, b"\x01" * 402, ".u32"), 32), ValueError, "uint32"),
    (
        "data-uint32-named-bin",
        lambda t: load_splits(token_file(t, np.arange(1, 500, dtype=np.uint32).tobytes(), ".bin"), 32),
        ValueError,
        "rename it to .u32",
    ),
    ("config-train-compile", lambda t: load_config(None, ["train.compile=maybe"]), ValueError, "train.compile"),
    ("config-fused-optimizer", lambda t: load_config(None, ["train.fused_optimizer=fast"]), ValueError, "fused"),
    ("config-device", lambda t: load_config(None, ["train.device=gpu0"]), ValueError, "train.device"),
    # Reliability II: untrusted and damaged files, a dying rank's timeout, ids past the vocabulary
    ("config-timeout", lambda t: load_config(None, ["parallel.timeout_s=0"]), ValueError, "parallel.timeout_s"),
    ("config-yaml-code", lambda t: load_config(yaml_file(t, "!!python/object/apply:os.getcwd []")), ValueError, "YAML"),
    ("ckpt-not-a-checkpoint", lambda t: load_ckpt(t, lambda p, m: p.write_text("hi")), CheckpointError, "ckpt.pt"),
    ("ckpt-cut-short", lambda t: load_ckpt(t, cut_short), CheckpointError, "cut short"),
    ("ckpt-pickled-object", lambda t: load_ckpt(t, pickled_object), CheckpointError, "trust_file=True"),
    ("ckpt-newer-format", lambda t: load_ckpt(t, newer_format), CheckpointError, f"version {FORMAT_VERSION + 1}"),
    ("data-ids-past-vocab", lambda t: train_on(t, np.full(500, 300, np.uint16)), ValueError, "model.vocab_size=256"),
    # Reliability III: every field a file gives is checked by name before it is used
    (
        "ckpt-no-step",
        lambda t: load_ckpt(t, lambda p, m: torch.save({"model": m.state_dict()}, p)),
        CheckpointError,
        "step=None",
    ),
    ("ckpt-no-model", lambda t: load_ckpt(t, lambda p, m: torch.save({"step": 1}, p)), CheckpointError, "('model')"),
    ("hf-no-hidden-size", lambda t: hf_llama(t, hidden_size=None), UnsupportedCheckpoint, "hidden_size missing"),
    ("hf-no-vocab-size", lambda t: hf_llama(t, vocab_size=None), UnsupportedCheckpoint, "vocab_size missing"),
    ("hf-zero-heads", lambda t: hf_llama(t, num_attention_heads=0), UnsupportedCheckpoint, "num_attention_heads=0"),
    ("hf-gpt2-zero-heads", lambda t: hf_llama(t, model_type="gpt2", n_head=0), UnsupportedCheckpoint, "n_head=0"),
    ("hf-config-not-json", lambda t: hf_llama(t, text="{model"), UnsupportedCheckpoint, "config.json is not JSON"),
    ("hf-mode-no-mode-config", lambda t: hf_llama(t, model_type="mode_moe"), UnsupportedCheckpoint, "mode_config"),
    ("hf-index-no-weight-map", lambda t: hf_llama(t, index={"metadata": {}}), UnsupportedCheckpoint, "weight_map"),
    ("hf-damaged-shard", lambda t: hf_llama(t, weights=b"\xff" * 64), UnsupportedCheckpoint, "model.safetensors"),
    ("meta-no-tokenizer", lambda t: prepared(t, tokenizer=None), ValueError, "tokenizer=None"),
    ("meta-bytes-per-token-0", lambda t: prepared(t, bytes_per_token=0), ValueError, "bytes_per_token=0"),
    ("meta-id-past-vocab", lambda t: prepared(t, vocab_size=100), ValueError, "train_000.bin holds id"),
    (
        "data-glob-of-text",
        lambda t: load_splits(data_file(t, 400).replace("corpus", "*"), 32),
        ValueError,
        "not token files",
    ),
]


def hf_llama(tmp_path, text: str | None = None, weights: bytes | None = None, index: dict | None = None, **fields):
    """``from_hf`` on a Hugging Face directory: a small llama ``config.json`` with ``fields``
    changed (None removes one) or ``text`` as the whole file, one tensor (or ``weights`` as
    the file's bytes), and ``index`` as ``model.safetensors.index.json`` where given."""
    from safetensors.torch import save_file

    config = {"model_type": "llama", "hidden_size": D, "num_attention_heads": 2, "num_hidden_layers": 2}
    config |= {"intermediate_size": 32, "vocab_size": 256, **fields}
    out = tmp_path / "hf"
    out.mkdir()
    config = {k: v for k, v in config.items() if v is not None}
    (out / "config.json").write_text(text if text is not None else json.dumps(config))
    save_file({"lm_head.weight": torch.zeros(256, D)}, out / "model.safetensors")
    if weights is not None:
        (out / "model.safetensors").write_bytes(weights)
    if index is not None:
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    from_hf(out)


def prepared(tmp_path, **fields) -> None:
    """``load_corpus`` on a byte-level prepared directory whose ``meta.json`` has ``fields``
    changed (ids up to 255 in its shards)."""
    out = tmp_path / "prep"
    out.mkdir()
    for name in ("train", "val"):
        (np.arange(400) % 256).astype(np.uint16).tofile(out / f"{name}_000.bin")
    meta = {"tokenizer": "bytes", "vocab_size": 256, "shards": {"train": ["train_000.bin"], "val": ["val_000.bin"]}}
    (out / "meta.json").write_text(json.dumps(meta | fields))
    load_corpus(str(out), 32)


def yaml_file(tmp_path, model_value: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(f"model: {model_value}\n")
    return str(path)


def load_ckpt(tmp_path, spoil) -> None:
    """Save a tiny model's checkpoint, ``spoil(path, model)`` it, load it back."""
    path, model = tmp_path / "ckpt.pt", lm()
    checkpoint.save(path, model, progress=checkpoint.Progress(1))
    spoil(path, model)
    checkpoint.load_checkpoint(path, model)


def cut_short(path, model) -> None:
    path.write_bytes(path.read_bytes()[:1000])


def pickled_object(path, model) -> None:
    """An object that only full unpickling can build (the table's stand-in for a payload; the
    ``os.system`` payload itself is in ``test_checkpoint_safety``)."""
    torch.save({"model": model.state_dict(), "step": 1, "payload": fractions.Fraction(1, 3)}, path)


def newer_format(path, model) -> None:
    torch.save({"model": model.state_dict(), "step": 1, "format_version": FORMAT_VERSION + 1}, path)


def train_on(tmp_path, tokens: np.ndarray) -> None:
    source = token_file(tmp_path, tokens.tobytes(), ".bin")
    mode.train.main(["--config", "dense", "data.source=" + source, "model.seq_len=32", f"train.out_dir={tmp_path}"])


def token_file(tmp_path, data: bytes, suffix: str) -> str:
    path = tmp_path / f"tokens{suffix}"
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("build,error,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_a_named_error(build, error, words, tmp_path):
    with pytest.raises(error) as info:
        build(tmp_path)
    assert words in str(info.value), str(info.value)


def test_the_table_has_a_row_per_case():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


def test_a_rank_may_hold_an_empty_batch():
    """Layers accept zero tokens (under expert parallelism a rank can hold none)."""
    assert mode.DroplessMoE(D, 32, 4)(torch.randn(0, D)).shape == (0, D)
    assert mode.MoDBlock(D, 2)(torch.randn(0, 8, D)).shape == (0, 8, D)


def test_generate_past_seq_len_slides_its_window_by_default():
    model = lm("model.layout=dense").eval()
    out = model.generate(ids(1, 30), 8, temperature=0)
    assert out.shape == (1, 38)
