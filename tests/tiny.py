"""The tiny model most tests train: config overrides shared by the test modules."""

TINY_MODEL = ["model.d_model=32", "model.n_heads=4", "model.n_layers=2", "model.seq_len=32", "model.moe.n_experts=4"]
