"""`lazytrain` entry point: exit-code mapping of job failures, bad configs and bugs."""

from __future__ import annotations

import subprocess
import sys

import pytest

import lazytrain.cli.main as cli_main
import lazytrain.cli.plan as cli_plan
from lazytrain.cli.main import main


@pytest.fixture
def plan_only(monkeypatch):
    """Register only `plan`, so another verb's import cannot fail these tests."""
    monkeypatch.setattr(cli_main, "COMMANDS", {"plan": cli_main.COMMANDS["plan"]})


def _raising(exc: BaseException):
    def run(args):
        raise exc
    return run


def test_hbm_budget_exceeded_during_a_job_exits_1_with_one_line(plan_only, monkeypatch, capsys):
    from lazytrain.runtime.errors import HbmBudgetExceeded
    exc = HbmBudgetExceeded(window="b3", held_bytes=12, limit_bytes=10)
    monkeypatch.setattr(cli_plan, "run", _raising(exc))
    assert main(["plan"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("error: window b3: activation store holds 12 HBM bytes, over the plan's "
                   "hbm_checkpoint_bytes 10 by 2")


def test_a_plain_assertion_error_is_a_bug_and_keeps_its_traceback(plan_only, monkeypatch):
    monkeypatch.setattr(cli_plan, "run", _raising(AssertionError("internal invariant")))
    with pytest.raises(AssertionError, match="internal invariant"):
        main(["plan"])


def test_plan_loads_neither_torch_nor_the_runtime(repo_root):
    # plan reads the calibration cache through profile/calibrate.py, never the runtime; with
    # calibration off (the suite's LAZYTRAIN_CALIBRATE=off, inherited here) it loads no torch
    # (on: tests/cli/test_plan_torch_free.py)
    allowed = ("lazytrain.runtime", "lazytrain.profile.calibrate")
    code = ("import sys; from lazytrain.cli.main import main; "
            f"rc = main(['plan', '--policy', 'megatrain', '--config', "
            f"{str(repo_root / 'configs' / 'tiny-llama-cpu.yaml')!r}]); "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('lazytrain.runtime') "
            f"and m not in {allowed!r}]; "
            "print(bad); sys.exit(rc or (3 if bad else 0))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-500:] + res.stderr[-2000:]


@pytest.mark.parametrize("args,needle", [
    (["--set", "hardware.hbm_gb=.inf"], "hardware.hbm_gb must be a finite number"),
    (["--set", "hardware.h2d_gb_per_s=1e-300"], "hardware.h2d_gb_per_s must be in [0.001"),
    (["--set", "train.lr=.inf"], "train.lr must be a finite number"),
    (["--model", "{tmp}/hostname"], "/hostname is not a JSON HF config"),
])
def test_garbage_config_values_exit_2_with_one_line_naming_the_key(plan_only, tmp_path, args,
                                                                   needle, capsys):
    (tmp_path / "hostname").write_text("myhost\n")
    args = [a.format(tmp=tmp_path) for a in args]
    assert main(["plan", "--policy", "megatrain", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("args", [["--set", "train.lr=-1"], ["--set", "train.steps=many"],
                                  ["--config", "{tmp}/nope.yaml"]])
def test_a_config_error_exits_2_by_its_class_not_by_its_builtin_base(plan_only, monkeypatch,
                                                                    tmp_path, args, capsys):
    monkeypatch.setattr(cli_main, "_builtin_exit_code", lambda exc: None)  # no builtin fallback
    args = [a.format(tmp=tmp_path) for a in args]
    assert main(["plan", "--policy", "megatrain", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1


@pytest.mark.parametrize("text,needle", [
    ("train: [\n", "not valid YAML (line 2, column 1"),
    ("1: 2\n", "unknown config key 1;"),
])
def test_broken_config_files_exit_2_with_one_line_naming_the_problem(plan_only, tmp_path, text,
                                                                     needle, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main(["plan", "--policy", "megatrain", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and len(err.splitlines()) == 1


def test_version_prints_the_package_version(capsys):
    from lazytrain import __version__
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"lazytrain {__version__}"


def _exit_code_cases():
    from lazytrain.dist.shared_masters import OwnerUpdateError
    from lazytrain.dist.rank import RankFailureError
    from lazytrain.planner.infeasible import PlanInfeasibleError
    from lazytrain.planner.plan import PlanValidationError
    from lazytrain.runtime.errors import (CheckpointNotResidentError, HbmBudgetExceeded,
                                          HostBudgetExceeded, NvmeIOError, TransferOrderError)
    from lazytrain.runtime.hb_checker import OrderingViolation
    from lazytrain.runtime.nvme import NvmeTimeoutError
    from lazytrain.spec.hub import HubModelError
    from lazytrain.train.checkpoint import CheckpointError
    from lazytrain.train.loop import CheckpointSaveError
    from lazytrain.train.preflight import PreflightError
    from lazytrain.train.locks import NvmeDirInUseError, RunDirInUseError
    return [
        (ValueError("train.lr must be > 0; got -1"), 2),
        (TypeError("train.steps must be int; got 'x'"), 2),
        (FileNotFoundError("data.path: /x.jsonl does not exist; fix the path"), 2),
        (CheckpointError("--resume: /r has no checkpoint; train without --resume"), 2),
        (HubModelError("model.config_path: Org/X is not in the cache"), 2),
        (PlanValidationError("boundary 3: h2d in window b9 is outside its legal windows"), 2),
        (PlanInfeasibleError(budget="HBM", window="f3", shortfall_bytes=2e9), 1),
        (PreflightError("preflight: host memory: need 9 GB, have 3 GB"), 1),
        (CheckpointSaveError("saving checkpoint step-000002 failed (No space left)"), 1),
        (NvmeIOError("disk full", boundary=3, path="/nvme/ckpt_b3.bin"), 1),
        (NvmeTimeoutError("no answer in 300 s", boundary=3, path="/nvme/ckpt_b3.bin"), 1),
        (HbmBudgetExceeded(window="b3", held_bytes=12, limit_bytes=10), 1),
        (HostBudgetExceeded(window="f0", held_bytes=12, limit_bytes=10, owner="pool"), 1),
        (CheckpointNotResidentError("boundary 2 (micro-batch 0): not in HBM", boundary=2), 1),
        (TransferOrderError("boundary 2 (micro-batch 0): h2d before d2h", boundary=2), 1),
        (OrderingViolation("buf w0: copy and read unordered", buffer="w0", first="copy on h2d",
                           second="read on compute", rule="write-read"), 1),
        (RankFailureError("rank 1 of 2: a collective failed"), 1),
        (OwnerUpdateError("rank 1 failed to update block3"), 1),
        (NvmeDirInUseError("runtime.nvme_dir: /n is in use by another job (pid 7)"), 1),
        (RunDirInUseError("train.run_dir: /r is in use by another job (pid 7)"), 1),
        (OSError(28, "No space left on device"), 1),
        (RuntimeError("rank 1 of 2: a collective failed"), 1),
    ]


@pytest.mark.parametrize("index", range(22))
def test_every_error_class_maps_to_its_exit_code_with_one_line(plan_only, monkeypatch, capsys,
                                                                index):
    exc, code = _exit_code_cases()[index]
    monkeypatch.setattr(cli_plan, "run", _raising(exc))
    assert main(["plan"]) == code, type(exc).__name__
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == "error: " + " ".join(str(exc).split())


def _project_exception_classes() -> dict[str, type]:
    """Every exception class defined in a module of `lazytrain` ("module.Name" -> class)."""
    import importlib
    import inspect
    import pkgutil

    import lazytrain
    found = {}
    for info in pkgutil.walk_packages(lazytrain.__path__, "lazytrain."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__ == module.__name__):
                found[f"{module.__name__}.{name}"] = obj
    return found


def test_every_project_error_derives_from_exactly_one_of_the_two_bases():
    from lazytrain.errors import EXIT_CODES, JobFailure, UserError
    classes = _project_exception_classes()
    assert {"lazytrain.runtime.errors.HbmBudgetExceeded", "lazytrain.train.checkpoint."
            "CheckpointError"} <= set(classes)  # the walk found the modules
    bases = {name: [b for b in EXIT_CODES if issubclass(cls, b)] for name, cls in classes.items()
             if cls not in (UserError, JobFailure)}
    unclassed = {name for name, found in bases.items() if not found}
    assert not unclassed, sorted(unclassed)
    assert all(len(found) <= 1 for found in bases.values()), bases


@pytest.mark.parametrize("index", range(22))
def test_every_project_error_maps_to_its_exit_code_by_its_class_alone(plan_only, monkeypatch,
                                                                      capsys, index):
    exc, code = _exit_code_cases()[index]
    if not type(exc).__module__.startswith("lazytrain."):
        pytest.skip("a builtin exception: mapped by its builtin base")
    monkeypatch.setattr(cli_plan, "run", _raising(exc))
    monkeypatch.setattr(cli_main, "_builtin_exit_code", lambda exc: None)  # no builtin fallback
    assert main(["plan"]) == code, type(exc).__name__
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_plan_infeasible_is_a_job_failure_and_no_value_error():
    from lazytrain.errors import JobFailure
    from lazytrain.planner.infeasible import PlanInfeasibleError
    assert issubclass(PlanInfeasibleError, JobFailure)
    assert not issubclass(PlanInfeasibleError, ValueError)


def test_run_and_nvme_locks_and_checkpoint_saves_keep_their_builtin_bases():
    from lazytrain.errors import JobFailure
    from lazytrain.train.loop import CheckpointSaveError
    from lazytrain.train.locks import NvmeDirInUseError, RunDirInUseError
    assert issubclass(CheckpointSaveError, JobFailure) and issubclass(CheckpointSaveError, OSError)
    for cls in (NvmeDirInUseError, RunDirInUseError):
        assert issubclass(cls, JobFailure) and issubclass(cls, RuntimeError)


def test_hbm_budget_exceeded_is_a_job_failure_and_no_assertion_error():
    from lazytrain.errors import JobFailure
    from lazytrain.runtime.errors import HbmBudgetExceeded
    assert issubclass(HbmBudgetExceeded, JobFailure)
    assert not issubclass(HbmBudgetExceeded, AssertionError)


@pytest.mark.parametrize("kind", ["user_error", "job_failure"])
def test_debug_keeps_the_traceback_of_a_user_error_and_of_a_job_failure(plan_only, monkeypatch,
                                                                         kind):
    from lazytrain.runtime.errors import HbmBudgetExceeded
    from lazytrain.train.checkpoint import CheckpointError
    exc = {"user_error": CheckpointError("--resume: /r has no checkpoint"),
           "job_failure": HbmBudgetExceeded(window="b3", held_bytes=12, limit_bytes=10)}[kind]
    monkeypatch.setattr(cli_plan, "run", _raising(exc))
    with pytest.raises(type(exc)):
        main(["--debug", "plan"])


def test_ctrl_c_outside_training_exits_130_with_one_line(plan_only, monkeypatch, capsys):
    monkeypatch.setattr(cli_plan, "run", _raising(KeyboardInterrupt()))
    assert main(["plan"]) == 130
    assert capsys.readouterr().err.strip() == "error: interrupted (Ctrl-C)"


def test_a_reader_that_closes_stdout_early_ends_quietly_with_status_0():
    # 10 MB of output into a pipe whose reader stops after 10 bytes (`... | head -c 10`)
    code = ("import sys, lazytrain.cli.main as m, lazytrain.cli.plan as p; "
            "m.COMMANDS = {'plan': m.COMMANDS['plan']}; "
            "p.run = lambda args: [print('x' * 1000) for _ in range(10000)] and 0; "
            "sys.exit(m.main(['plan']))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout.read(10) == b"x" * 10
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert "BrokenPipe" not in err and "Traceback" not in err and err == ""
