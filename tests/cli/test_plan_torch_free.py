"""`lazytrain plan` and `simulate` read this machine's cached calibration without loading torch.

The cache entry is written the way `lazytrain train` writes one, in a process where torch is
loaded and answers for itself (version, thread count); `lazytrain plan` then runs in a fresh
process that must find that same entry (its costs line says "calibrated"), and `simulate`
re-evaluates the written plan, while neither torch nor transformers is ever imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

WRITE_CACHE = """
import sys, torch
from lazytrain.cli.profile import analytic_profile
from lazytrain.config import load_config
from lazytrain.planner.build import problem_from_config
from lazytrain.profile import calibrate
from lazytrain.spec.model import ModelSpec
cfg = load_config(sys.argv[1], sys.argv[2:])
spec = ModelSpec.from_hf_config(cfg.model.config_path)
profile = analytic_profile(problem_from_config(cfg), [b.kind for b in spec.blocks], cfg)
profile["model_config_sha256"] = spec.config_sha256
for times in profile["block_kinds"].values():  # not the analytic times: a fallback would show
    times.update({k: 2 * v for k, v in times.items()})
fields = calibrate.key_fields(cfg, device="cpu")
assert fields["torch_version"] == torch.__version__
assert fields["torch_threads"] == torch.get_num_threads()
path = calibrate.cache_file(cfg, fields)
calibrate.write_cache(path, profile, fields)
print(path)
"""

RUN_VERB = """
import sys
from lazytrain.cli.main import main
rc = main(sys.argv[1:])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print("LOADED " + " ".join(heavy))
sys.exit(rc)
"""

MACHINE = """
import json, sys
from lazytrain.profile import machine
facts = {"version": machine.torch_version(), "threads": machine.torch_threads(),
         "cuda": machine.cuda_available()}
assert "torch" not in sys.modules
print(json.dumps(facts))
"""


def _env() -> dict:
    env = dict(os.environ)
    env.pop("LAZYTRAIN_CALIBRATE", None)  # the suite's off switch: this test reads a cache
    return env


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_plan_uses_the_cached_calibration_and_never_imports_torch(repo_root, tmp_path, device):
    config = str(repo_root / "configs" / "tiny-llama-cpu.yaml")
    sets = [f"runtime.calibration_dir={tmp_path / 'cal'}", f"runtime.device={device}"]
    wrote = subprocess.run([sys.executable, "-c", WRITE_CACHE, config, *sets],
                           capture_output=True, text=True, env=_env())
    assert wrote.returncode == 0, wrote.stderr[-2000:]
    cache = wrote.stdout.strip().splitlines()[-1]
    flags = [arg for s in sets for arg in ("--set", s)]
    plan = str(tmp_path / "plan.json")
    res = subprocess.run([sys.executable, "-c", RUN_VERB, "plan", "--config", config, *flags,
                          "--out", plan], capture_output=True, text=True, env=_env())
    assert res.returncode == 0, res.stdout[-1000:] + res.stderr[-2000:]
    assert f"costs: calibrated on this machine (cache {cache}, measured " in res.stdout
    assert res.stdout.strip().splitlines()[-1] == "LOADED"
    sim = subprocess.run([sys.executable, "-c", RUN_VERB, "simulate", plan, *flags],
                         capture_output=True, text=True, env=_env())
    assert sim.returncode == 0, sim.stdout[-1000:] + sim.stderr[-2000:]
    assert "warning" not in sim.stderr  # the same calibrated costs as the plan's
    assert sim.stdout.strip().splitlines()[-1] == "LOADED"


TORCH_SAYS = ("import json, torch; print(json.dumps({'version': torch.__version__, "
              "'threads': torch.get_num_threads(), 'cuda': torch.cuda.is_available()}))")


@pytest.mark.parametrize("threads_env", [{}, {"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "64"},
                                         {"OMP_NUM_THREADS": "64", "MKL_NUM_THREADS": "1"}],
                         ids=["default", "omp", "omp-over-the-cores", "mkl-over-omp"])
def test_the_torch_free_machine_facts_are_torchs_own(threads_env):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",
                                                              "MKL_NUM_THREADS")}
    env.update(threads_env)
    facts = []
    for code in (MACHINE, TORCH_SAYS):
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env)
        assert res.returncode == 0, res.stderr[-2000:]
        facts.append(json.loads(res.stdout))
    assert facts[0] == facts[1]
