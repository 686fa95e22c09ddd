"""The GRPO KL reference copy in the training preflight: with `grpo.kl_coef` > 0 the run holds
the initial weights in the compute dtype in host DRAM (P x 4 bytes for fp32 compute, P x 2 for
bf16), so the plan's DRAM plus that copy must fit `hardware.dram_gb`, and MemAvailable must
hold both. A run whose DRAM fits without the copy and not with it is refused before a file is
written, naming grpo.kl_coef; the same run with kl_coef 0 passes. Bytes by hand."""

from __future__ import annotations

import pytest

from lazytrain.spec.model import ModelSpec
from lazytrain.train import model_source
from lazytrain.train.loop import train
from lazytrain.train.preflight import (PreflightError, preflight, preflight_reference_budget,
                                       run_checks)
from train_helpers import tiny_config


def test_the_dram_budget_counts_the_reference_copy_by_hand():
    # plan 1000 B + copy 400 B = 1400 B: fits 1400, not 1399
    check = preflight_reference_budget(plan_dram_bytes=1000, reference_bytes=400,
                                       dram_bytes=1400, compute_dtype="fp32")
    assert (check.need_bytes, check.have_bytes, check.ok) == (1400, 1400, True)
    with pytest.raises(PreflightError) as err:
        preflight_reference_budget(plan_dram_bytes=1000, reference_bytes=400, dram_bytes=1399,
                                   compute_dtype="fp32")
    line = str(err.value)
    assert "need 1400 bytes, have 1399 bytes (hardware.dram_gb)" in line
    for fix in ("grpo.kl_coef: 0", "raise hardware.dram_gb", "train.compute_dtype: bf16"):
        assert fix in line, fix
    with pytest.raises(PreflightError) as err:  # bf16 compute already: no bf16 fix offered
        preflight_reference_budget(plan_dram_bytes=1000, reference_bytes=200, dram_bytes=1199,
                                   compute_dtype="bf16")
    assert "grpo.kl_coef: 0" in str(err.value) and "compute_dtype" not in str(err.value)


def test_host_memory_counts_the_reference_copy_by_hand(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 4096 kB\nMemAvailable: 1000 kB\n")  # 1,024,000 bytes
    kw = dict(device="cuda", hbm_bytes=0, pinned_bytes=0, nvme_bytes=0, nvme_dir=tmp_path,
              checkpoint_bytes=1, run_dir=tmp_path, meminfo=meminfo, cgroup_dir=tmp_path)
    # 900,000 B of plan fit alone; with a 200,000 B copy they need 1,100,000 B
    host = run_checks(host_bytes=900_000, **kw)[0]
    assert (host.name, host.need_bytes, host.ok) == ("host memory", 900_000, True)
    host = run_checks(host_bytes=900_000, reference_bytes=200_000, **kw)[0]
    assert (host.need_bytes, host.ok) == (1_100_000, False)
    with pytest.raises(PreflightError, match=r"need 1100000 bytes, have 1024000 bytes "
                                             r"\(MemAvailable\); the GRPO KL reference copy .*"
                                             r"grpo.kl_coef: 0"):
        preflight(host_bytes=900_000, reference_bytes=200_000, compute_dtype="fp32", **kw)


def _grpo_config(model_dir, run_dir, kl_coef: float, dram_gb: float):
    return tiny_config(model_dir, run_dir, "train.method=grpo", "train.compute_dtype=fp32",
                       "grpo.prompts_per_step=1", "grpo.n=2", f"grpo.kl_coef={kl_coef}",
                       "data.num_eval=0", f"hardware.dram_gb={dram_gb!r}",
                       "hardware.allow_implausible=true")


class _PassedPreflight(Exception):
    """Raised by the stubbed tokenizer load, the step right after the preflight."""


@pytest.mark.slow
def test_a_run_whose_dram_fits_only_without_the_copy_is_refused_naming_kl_coef(
        arithmetic_model_dir, tiny_plan, tmp_path, monkeypatch):
    params = ModelSpec.from_hf_config(arithmetic_model_dir / "config.json").total_params
    reference = 4 * params  # fp32 compute: every parameter once, 4 bytes
    plan_dram = int(tiny_plan.predicted.dram_bytes)
    dram_gb = (plan_dram + reference // 2) / 1e9  # the plan fits, the plan + copy do not
    run = tmp_path / "run"
    with pytest.raises(PreflightError) as err:
        train(_grpo_config(arithmetic_model_dir, run, 0.1, dram_gb), plan=tiny_plan,
              progress=False, log=lambda msg: None)
    line = str(err.value)
    assert f"need {plan_dram + reference} bytes" in line and "hardware.dram_gb" in line
    assert f"KL reference copy of the weights (grpo.kl_coef > 0) {reference} bytes" in line
    assert "set grpo.kl_coef: 0" in line
    assert not (run / "config.yaml").exists() and not (run / "plan.json").exists()
    assert not (run / "metrics.jsonl").exists()

    # kl_coef 0: no copy, the same DRAM passes the preflight (stopped right after it)
    def stop(*args, **kwargs):
        raise _PassedPreflight

    monkeypatch.setattr(model_source, "load_tokenizer", stop)
    with pytest.raises(_PassedPreflight):
        train(_grpo_config(arithmetic_model_dir, tmp_path / "run0", 0.0, dram_gb),
              plan=tiny_plan, progress=False, log=lambda msg: None)
