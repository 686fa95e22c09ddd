"""`lazytrain plan` on the shipped real-scale configs, one per model in ../shared/models/.

Every shipped config that points into ../shared/models is planned through the CLI (the user's
path: YAML -> problem -> policy -> simulator check) on the h800-paper and h200 presets. The
heuristic policy keeps the file fast; the MILP table lives in the issue note. Checks are
independent of the planner's own bookkeeping where possible: the tier list is re-counted
from the plan JSON, the HBM peak is compared with the preset's capacity.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lazytrain.cli.main import main
from lazytrain.config import load_config
from lazytrain.spec.hardware import PRESETS

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
TIERS = ("hbm", "dram", "nvme", "recompute")


def _model_path(config: Path) -> str:
    """model.config_path as written (raw YAML: listing needs no ../shared)."""
    return yaml.safe_load(config.read_text())["model"]["config_path"]


REAL_CONFIGS = sorted(p for p in CONFIGS_DIR.glob("*.yaml") if "shared/models/" in _model_path(p))


def test_every_shared_model_has_a_real_scale_config(shared_dir):
    models = {p.name for p in (shared_dir / "models").glob("*.json")}
    assert models <= {Path(_model_path(p)).name for p in REAL_CONFIGS}


@pytest.mark.parametrize("hardware", ["h800-paper", "h200"])
@pytest.mark.parametrize("config", REAL_CONFIGS, ids=[p.stem for p in REAL_CONFIGS])
def test_real_config_plans_within_the_budgets(config, hardware, shared_dir, capsys):
    code = main(["plan", "--config", str(config), "--hardware", hardware,
                 "--policy", "heuristic", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["comparison"]["violations"] == []
    plan = out["plan"]
    cfg = load_config(config)
    assert plan["provenance"]["seq_len"] == cfg.data.seq_len
    assert plan["provenance"]["micro_batch"] == cfg.train.micro_batch
    tiers = [b["tier"] for b in plan["boundaries"]]
    assert len(tiers) == len(plan["windows"]) // 2 + 1 and set(tiers) <= set(TIERS)
    assert plan["predicted"]["step_ms"] > 0
    assert plan["predicted"]["peak_hbm_bytes"] <= PRESETS[hardware].hbm_bytes
    assert out["comparison"]["speedup_vs_megatrain"] >= 1.0 - 1e-9
