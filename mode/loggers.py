"""Where a run's metrics go besides ``metrics.jsonl`` (always written): ``train.loggers``.

- ``jsonl``: ``<out_dir>/metrics.jsonl``, one JSON record per logged step (always on; listing
  it is allowed).
- ``tensorboard``: ``<out_dir>/tensorboard/`` event files (``torch.utils.tensorboard``; needs
  the ``tensorboard`` package, ``pip install 'mode-moe[tb]'``).
- ``wandb``: a Weights & Biases run in offline mode under ``<out_dir>/wandb`` (``wandb sync``
  uploads it later); needs ``wandb``.

A logger whose package is missing is skipped with its reason (the run goes on); every
scalar of a record is logged at the record's ``step``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Protocol

LOGGERS: tuple[str, ...] = ("jsonl", "tensorboard", "wandb")
PACKAGES = {"tensorboard": ("tensorboard", "pip install 'mode-moe[tb]'"), "wandb": ("wandb", "pip install wandb")}


class MetricSink(Protocol):
    def log(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    def __init__(self, out_dir: Path, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415

        self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"), flush_secs=10)
        self.writer.add_text("config", f"```\n{config}\n```")

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, out_dir: Path, config: dict, name: str) -> None:
        import wandb  # noqa: PLC0415

        self.run = wandb.init(project="mode-moe", name=name, dir=str(out_dir), mode="offline", config=config)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def missing_reason(name: str) -> str | None:
    """Why logger ``name`` cannot run here (its package is not installed), or None."""
    if name not in PACKAGES:
        return None
    package, install = PACKAGES[name]
    if importlib.util.find_spec(package) is None:
        return f"the {package} package is not installed ({install})"
    return None


def open_sinks(names: list[str], out_dir: Path, config: dict, name: str) -> tuple[list[MetricSink], list[str]]:
    """The sinks ``names`` ask for (``jsonl`` is the run log's own file) and a message for each
    one skipped."""
    sinks: list[MetricSink] = []
    skipped = []
    for logger in dict.fromkeys(names):
        if logger == "jsonl":
            continue
        reason = missing_reason(logger)
        if reason is not None:
            skipped.append(f"train.loggers: {logger} skipped: {reason}")
        elif logger == "tensorboard":
            sinks.append(TensorBoardSink(out_dir, config))
        else:
            sinks.append(WandbSink(out_dir, config, name))
    return sinks, skipped


def scalars(values: dict) -> dict[str, float]:
    """The numeric entries of a record (lists, strings and booleans left out)."""
    return {k: float(v) for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
