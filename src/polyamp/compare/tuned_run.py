"""One row of ``polyamp compare --tuned`` in a ``worker --serve`` process: a tune configuration's step."""

from __future__ import annotations

import importlib
import os
import time


class TunedRun:
    """A ``worker --serve`` process's tuned row: the front end's step for one tune configuration,
    on the workload's tune inputs; ``step`` returns its seconds, ``result`` the losses so far."""

    def __init__(self, framework: str, workload: str, policy: str, settings: dict, quick: bool,
                 env: tuple[str, ...] = ()):
        from ..tune import Candidate

        front = importlib.import_module(f"polyamp.{framework}.tune")
        inputs = importlib.import_module(f"polyamp.compare.{framework}").tune_inputs(workload, quick)
        self.built = front.Tunable(*inputs, name=workload).build(Candidate.of(policy, settings))
        self.losses: list[float] = []
        self.env = {name: os.environ.get(name) for name in env}  # as this process saw them

    def step(self, i: int) -> float:
        t0 = time.perf_counter()
        loss = float(self.built.step(i))
        seconds = time.perf_counter() - t0
        self.losses.append(loss)
        return seconds

    def result(self, evaluate: bool) -> dict:
        return {"losses": self.losses}
