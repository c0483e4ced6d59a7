"""Which of a training step's jobs run: answered once per step, before it (as torchtitan's
``should_log`` / ``should_validate`` / the checkpointer's ``last_step``), so a step computes
its routing metrics exactly when its record is written.

``cadence = Cadence(train_config, stop_at)``; ``plan = cadence.plan(done, overdue)`` before
the step that makes ``done`` steps, ``plan = cadence.after(plan, overdue)`` once it ran:

- ``last``: the run ends after this step: ``train.steps`` reached, ``stop_at`` (a
  preemption), or the time budget (``train.max_seconds``) spent. A step that spends the
  budget is the last if its record was planned (it then evaluates too); otherwise the run
  takes one more step, planned as the last (``overdue``), so the last record always carries
  the routing metrics and the health warnings can fire on it. The budget is overrun by at
  most that one step;
- ``save``: every ``train.ckpt_every`` steps (the final checkpoint is the loop's);
- ``evaluate``: every ``train.eval_every`` steps and on the last;
- ``record``: every ``train.log_every`` steps and whenever it evaluates or saves;
- ``metrics``: the step computes its routing metrics: exactly when it is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mode.config import TrainConfig

__all__ = ["Cadence", "StepPlan"]


@dataclass(frozen=True)
class StepPlan:
    last: bool
    save: bool
    evaluate: bool
    record: bool

    @property
    def metrics(self) -> bool:
        return self.record


@dataclass(frozen=True)
class Cadence:
    train: TrainConfig
    stop_at: int | None = None

    def out_of_time(self, elapsed: float) -> bool:
        """Whether ``elapsed`` training seconds have spent the budget (``train.max_seconds`` > 0)."""
        return bool(self.train.max_seconds) and elapsed >= self.train.max_seconds

    def plan(self, done: int, overdue: bool = False) -> StepPlan:
        """The jobs of the step that makes ``done`` steps (``overdue``: an earlier step spent
        the time budget; this one ends the run)."""
        tc = self.train
        last = done >= tc.steps or done == self.stop_at or overdue
        save = bool(tc.ckpt_every) and done % tc.ckpt_every == 0
        evaluate = done % tc.eval_every == 0 or last
        record = done % tc.log_every == 0 or evaluate or save
        return StepPlan(last=last, save=save, evaluate=evaluate, record=record)

    def after(self, plan: StepPlan, overdue: bool) -> StepPlan:
        """``plan`` once its step ran: a recorded step that spent the budget (``overdue``)
        becomes the last, and evaluates."""
        if overdue and plan.record and not plan.last:
            return replace(plan, last=True, evaluate=True)
        return plan
