"""Host bytes converted and accumulated per block per micro-batch, for each plan kind and each
weight path (docs/execution_model.md, "Weight paths"): "before" is today's path
(host_convert: every block load converts the master into a staging buffer), "after" the
plan's pinned_copy or gpu_cast (no block conversion; the ends still load through the staging
ring once per step). Runs the tiny Llama of the engine tests (4 blocks, fp32 masters; and
bf16 masters under fp32 compute, where pinned_copy keeps a real compute-dtype copy) on the
`cpu` backend, one step of 2 micro-batches, counting the bytes the host writes.

    PYTHONPATH=src python benchmarks/host_bytes.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime"))
from engine_helpers import micro_batches, model_pair, problem_for, tiny_config  # noqa: E402

from lazytrain.models import adapter_from_model  # noqa: E402
from lazytrain.models.host_params import ParamGroup  # noqa: E402
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers  # noqa: E402
from lazytrain.planner.plan import SolveRecord  # noqa: E402
from lazytrain.runtime import streams  # noqa: E402
from lazytrain.runtime.build import make_engine  # noqa: E402

R, H, D, N = "recompute", "hbm", "dram", "nvme"
KINDS = {"all_hbm": [H] * 5, "all_dram": [D] * 4 + [H], "mixed_tiers": [R, D, H, N, H],
         "segments_of_2": [H, R, H, R, H], "one_segment_of_4": [R] * 4 + [H]}
PATHS = ("host_convert", "pinned_copy", "gpu_cast")
MICRO = 2


def _adapter(master_dtype: str):
    if master_dtype == "fp32":
        return model_pair(tiny_config("llama"))[1]
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    return adapter_from_model(model, master_dtype=master_dtype)


def measure(kind: str, path: str, master_dtype: str, nvme_dir: Path) -> tuple[float, float]:
    """(converted, accumulated) host bytes per block per micro-batch of one step."""
    adapter = _adapter(master_dtype)
    problem = problem_for(adapter, grad_accum=MICRO)
    d = decisions_from_tiers(problem, tuple(KINDS[kind]))
    plan = build_plan(problem, dataclasses.replace(d, weight_paths=(path,) * adapter.num_blocks),
                      solver=SolveRecord(backend="manual"))
    block_sizes = {g.numel for g in adapter.params.blocks}
    counts = {"convert": 0, "accumulate": 0}
    convert, accumulate = streams.DeviceWeights.convert, ParamGroup.accumulate_grad

    def counting_convert(self, staging, master):
        if master.numel() in block_sizes:  # block loads, not the ends' chunks
            counts["convert"] += staging[:master.numel()].numel() * staging.element_size()
        convert(self, staging, master)

    def counting_accumulate(self, flat_grad, *, first, start=0):
        if flat_grad is not None and self.numel in block_sizes:
            counts["accumulate"] += flat_grad.numel() * self.grad.element_size()
        accumulate(self, flat_grad, first=first, start=start)

    streams.DeviceWeights.convert = counting_convert
    ParamGroup.accumulate_grad = counting_accumulate
    try:
        engine = make_engine(adapter, plan, device="cpu", nvme_dir=nvme_dir, grad_accum=MICRO)
        try:
            engine.step(micro_batches(MICRO))
        finally:
            engine.close()
    finally:
        streams.DeviceWeights.convert, ParamGroup.accumulate_grad = convert, accumulate
    per = adapter.num_blocks * MICRO
    return counts["convert"] / per, counts["accumulate"] / per


def main() -> None:
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        for master in ("fp32", "bf16"):
            adapter = _adapter(master)
            numel = adapter.params.blocks[0].numel
            print(f"masters {master}, compute fp32; block {numel} params; bytes per block per "
                  f"micro-batch (converted / accumulated on the host)")
            print(f"{'plan kind':<18}" + "".join(f"{p:>26}" for p in PATHS))
            for kind in KINDS:
                cells = []
                for n, path in enumerate(PATHS):
                    conv, acc = measure(kind, path, master, Path(tmp) / f"{kind}{master}{n}")
                    cells.append(f"{conv:>12.0f} / {acc:>10.0f}")
                print(f"{kind:<18}" + "".join(f"{c:>26}" for c in cells))
            print()


if __name__ == "__main__":
    main()
