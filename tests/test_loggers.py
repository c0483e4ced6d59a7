"""``train.loggers``: TensorBoard event files with the run's scalars, wandb skipped with its
reason where it is not installed, messages through the ``mode`` Python logger."""

import importlib.util
import logging

import pytest

from mode.checks import ConfigError
from mode.config import load_config
from mode.train import train
from tests.tiny import TINY

RUN = [*TINY, "model.layout=dense,mod", "train.steps=3", "train.eval_every=3"]


def test_tensorboard_gets_every_logged_scalar(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(None, [*RUN, f"train.out_dir={tmp_path}", "train.loggers=[jsonl,tensorboard]"])
    train(cfg)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "loss" in tags and "val_loss" in tags and any(t.endswith("routed_share") for t in tags)
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_a_logger_without_its_package_is_skipped_with_the_reason(tmp_path, capsys):
    cfg = load_config(None, [*RUN, f"train.out_dir={tmp_path}", "train.loggers=[wandb]", "train.progress=true"])
    _, result = train(cfg)
    assert result.steps == 3
    assert "train.loggers: wandb skipped: the wandb package is not installed" in capsys.readouterr().out


def test_an_unknown_logger_is_refused_by_name():
    with pytest.raises(ConfigError, match="train.loggers"):
        load_config(None, ["train.loggers=[mlflow]"])


def test_messages_go_through_the_mode_logger(tmp_path):
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("mode")
    keep = Keep()
    logger.addHandler(keep)
    try:
        train(load_config(None, [*RUN, f"train.out_dir={tmp_path}", "train.progress=true"]))
    finally:
        logger.removeHandler(keep)
    assert any("device cpu" in r.getMessage() and r.levelno == logging.INFO for r in records)
