"""The tiny training run most tests make: one list of overrides, shared by the test modules.

``TINY_MODEL`` is the model (two layers of width 32 over 32 tokens, four experts);
``TINY_RUN`` the run around it: ten steps of batch 8 on a step-based schedule (no wall-clock
budget, so a loaded machine trains the same run), one evaluation batch, a log line every step,
no progress bar. ``TINY`` is both. A test states only what it changes, after them (a later
override wins).
"""

TINY_MODEL = ["model.d_model=32", "model.n_heads=4", "model.n_layers=2", "model.seq_len=32", "model.moe.n_experts=4"]
TINY_RUN = [
    "train.batch_size=8",
    "train.steps=10",
    "train.eval_every=10",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.progress=false",
    "train.max_seconds=0",
    "train.lr=3e-3",
    "train.warmup_steps=2",
]
TINY = [*TINY_MODEL, *TINY_RUN]
