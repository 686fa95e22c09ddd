"""Model, hardware and cost specifications: the planner's inputs (never imports torch).

- `model.ModelSpec`: architecture from a HF config.json (parameters, FLOPs, saved activations);
  one `block.BlockSpec` per layer, parsed per family in `families`.
- `hardware.HardwareSpec` + `PRESETS`: capacities, bandwidths, compute rate of a machine.
- `costs.BlockCosts` / `ModelCosts`: per-block ms and bytes, analytic or from a measured profile.
- `saved_bytes.SavedSet`: what a block keeps at save levels L1 / L2, per part and per token.

The planning problem is assembled above this layer, in `lazytrain.planner.build`.
"""

from lazytrain.spec.costs import BlockCosts, ModelCosts, analytic_costs, profile_costs
from lazytrain.spec.hardware import (PRESETS, HardwareSpec, get_hardware, load_hardware,
                                     save_hardware)
from lazytrain.spec.block import BlockSpec
from lazytrain.spec.model import ModelSpec

__all__ = ["BlockCosts", "BlockSpec", "HardwareSpec", "ModelCosts", "ModelSpec", "PRESETS",
           "analytic_costs", "get_hardware", "load_hardware", "profile_costs", "save_hardware"]
