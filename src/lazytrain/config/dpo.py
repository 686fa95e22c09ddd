"""The `dpo:` config section (read with `train.method: dpo`), composed by `RunConfig`.

Owns each key's name, type, default, documentation and range checks, as `sections.py` does for
the other sections; imports neither torch nor a solver.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from lazytrain.config.checks import check, check_finite


@dataclass(kw_only=True, frozen=True, slots=True)
class DPOConfig:
    """`dpo:` direct preference optimisation (`train.method: dpo`; `lazytrain.train.dpo`)."""

    beta: float = 0.1
    """Inverse temperature of the implicit KL penalty, > 0: the loss sees beta * (log-ratio
    difference of chosen and rejected). 0.1: the DPO paper's and TRL's default."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: -log sigmoid(beta * z), the DPO paper's loss; ipo: (z' - 1/(2 beta))^2 on
    per-token mean log-ratios (IPO; TRL's normalisation)."""

    def __post_init__(self) -> None:
        check_finite(self, "dpo")
        check(self.beta > 0, "dpo.beta", "> 0", self.beta)


def planning_config(cfg):
    """The config the planner sees: with `train.method: dpo`, `train.micro_batch` pairs are
    2 x micro_batch rows (chosen and rejected in one micro-batch); else `cfg` itself. The
    trainer and `lazytrain plan` both plan through it, so they plan the same rows."""
    if cfg.train.method != "dpo":
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, micro_batch=2 * cfg.train.micro_batch))
