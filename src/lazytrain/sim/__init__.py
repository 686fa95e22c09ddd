"""Independent discrete-event simulation of a Plan over streams (compute, h2d, d2h, nvme_read,
nvme_write) with explicit dependencies; `disagreements` lists where it disagrees with the fluid
window evaluator (`lazytrain.planner.evaluate`). Imports the planner's Plan/problem, never a
solver or torch."""

from lazytrain.sim.simulate import (SimEvent, SimOptions, SimResult, SimWindow, disagreements,
                                    simulate)

__all__ = ["SimEvent", "SimOptions", "SimResult", "SimWindow", "disagreements", "simulate"]
