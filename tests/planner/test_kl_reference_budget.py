"""The GRPO KL reference copy in the planner's DRAM budget: the memory model records it
(`reference_bytes`) and leaves it out of the room for DRAM-tier checkpoints and of the runtime's
pinned limit; a DRAM shortfall it causes names grpo.kl_coef; `lazytrain plan` shows it on the
host DRAM line and refuses a DRAM that fits only without it.

Hand numbers: SmolLM2-135M (the default model) has 134,515,008 parameters; fp32 masters hold
16 B of each (2.152 GB), fp32 compute makes a 4 B/param copy (0.538 GB)."""

from __future__ import annotations

from lazytrain.cli.main import main
from lazytrain.config import load_config
from lazytrain.planner.build import problem_from_config
from lazytrain.planner.infeasible import shortfall_fix
from lazytrain.planner.memory_model import memory_model_of

PARAMS = 134_515_008
GRPO = ["train.method=grpo", "grpo.prompts_per_step=2", "grpo.n=2", "train.micro_batch=4"]


def test_the_memory_model_books_the_copy_by_hand():
    base = problem_from_config(load_config(None, GRPO))
    kl = problem_from_config(load_config(None, [*GRPO, "grpo.kl_coef=0.1"]))
    assert "reference_bytes" not in base.provenance["memory"]  # no copy: the plan JSON as before
    mem, mem0 = memory_model_of(kl.provenance), memory_model_of(base.provenance)
    assert mem.reference_bytes == PARAMS * 4
    assert (mem0.dram_free_for_checkpoints_bytes - mem.dram_free_for_checkpoints_bytes
            == PARAMS * 4)
    # the budget the plan was made to fit is the problem's DRAM row: hardware DRAM less the copy
    assert mem.dram_budget_bytes == kl.dram_bytes == base.dram_bytes - PARAMS * 4
    bf16 = problem_from_config(load_config(None, [*GRPO, "grpo.kl_coef=0.1",
                                                  "train.compute_dtype=bf16"]))
    assert memory_model_of(bf16.provenance).reference_bytes == PARAMS * 2


def test_a_dram_shortfall_names_the_kl_coef_only_with_a_copy():
    kl = problem_from_config(load_config(None, [*GRPO, "grpo.kl_coef=0.1"]))
    fix = shortfall_fix("DRAM", kl)
    assert fix.startswith("set grpo.kl_coef: 0 (its KL reference copy of the weights holds "
                          "0.54 GB of hardware.dram_gb)")
    assert "train.compute_dtype: bf16" in fix and "raise hardware.dram_gb" in fix
    base = problem_from_config(load_config(None, GRPO))
    assert "kl_coef" not in shortfall_fix("DRAM", base)
    assert "compute_dtype" not in shortfall_fix("DRAM", base)


def test_plan_refuses_a_dram_that_fits_only_without_the_copy(capsys):
    # 2.5 GB: states 2.152 GB + copy 0.538 GB = 2.690 GB do not fit, whatever the staging;
    # without the copy the states and the staging pools (under 0.35 GB here) do
    args = ["plan", "--policy", "heuristic", *(x for o in GRPO for x in ("--set", o)),
            "--set", "hardware.dram_gb=2.5"]
    assert main([*args, "--set", "grpo.kl_coef=0.1"]) == 1
    err = capsys.readouterr().err
    assert "DRAM short by" in err and "set grpo.kl_coef: 0" in err
    assert main([*args, "--set", "grpo.kl_coef=0"]) == 0
    out = capsys.readouterr().out
    (dram,) = [ln for ln in out.splitlines() if ln.startswith("host DRAM:")]
    assert " of 2.50 GB" in dram and "reference" not in dram


def test_plan_shows_the_copy_on_the_host_dram_line(capsys):
    assert main(["plan", "--policy", "heuristic", *(x for o in GRPO for x in ("--set", o)),
                 "--set", "grpo.kl_coef=0.1", "--set", "hardware.dram_gb=100"]) == 0
    (dram,) = [ln for ln in capsys.readouterr().out.splitlines()
               if ln.startswith("host DRAM:")]
    # 100 GB less 0.538 GB = 99.46 GB of budget
    assert " of 99.46 GB" in dram
    assert "less the GRPO KL reference copy of the weights (grpo.kl_coef), 0.54 GB" in dram
