"""A job left alone: no code execution from run files, no silent fresh start or wrong model on
--resume, run directories that are not mixed, checkpoints that survive Ctrl-C and full disks,
and a resume with dropout and evaluation that is bit-identical."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal

import pytest
import torch
import yaml
from safetensors.torch import load_file

import lazytrain.train.loop as loop
from lazytrain.cli.main import main
from lazytrain.train import checkpoint as ckpt
from lazytrain.train.loop import TrainHooks, train
from train_helpers import tiny_config

pytestmark = pytest.mark.slow


def _config_file(tmp_path, model_dir, name="run.yaml", **train_keys):
    cfg = {"model": {"config_path": str(model_dir)},
           "data": {"seq_len": 160, "num_eval": 0},
           "train": {"micro_batch": 2, "steps": 2, "lr": 3e-3, "warmup_steps": 0, **train_keys},
           "planner": {"policy": "megatrain", "megatrain_k": 2},
           "runtime": {"device": "cpu"}}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def _steps(run_dir):
    return [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _one_error_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.startswith("error")]
    assert len(err) == 1, err
    return err[0]


def _fix_marker(checkpoint_dir):
    """Rewrite COMPLETE with the current file sizes and digests (what an attacker would do)."""
    marker = json.loads((checkpoint_dir / ckpt.MARKER).read_text())
    marker["files"] = {n: (checkpoint_dir / n).stat().st_size for n in marker["files"]}
    marker["xxh3"] = {n: ckpt.file_digest(checkpoint_dir / n) for n in marker["files"]}
    (checkpoint_dir / ckpt.MARKER).write_text(json.dumps(marker))


class _Payload:
    """Unpickling this calls Path.touch(target): the proof that code ran."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        from pathlib import Path
        return (Path.touch, (Path(self.target),))


# --- security ---------------------------------------------------------------------------------

def test_a_trainer_state_holding_a_code_object_is_refused_and_nothing_runs(
        arithmetic_model_dir, tiny_plan, tmp_path):
    run = tmp_path / "run"
    cfg = tiny_config(arithmetic_model_dir, run, "train.steps=1", "data.num_eval=0")
    train(cfg, plan=tiny_plan, progress=False)
    saved = ckpt.latest_checkpoint(run)
    state = torch.load(saved.path / ckpt.STATE_FILE, weights_only=True)  # ours loads safely
    proof = tmp_path / "code-ran"
    torch.save({**state, "evil": _Payload(proof)}, saved.path / ckpt.STATE_FILE)
    _fix_marker(saved.path)
    assert ckpt.latest_checkpoint(run) is not None  # the size check alone does not catch it

    with pytest.raises(ckpt.CheckpointError, match="refused to load") as info:
        train(tiny_config(arithmetic_model_dir, run, "train.steps=2", "data.num_eval=0"),
              resume=True, progress=False)
    assert str(saved.path / ckpt.STATE_FILE) in str(info.value)
    assert not proof.exists(), "unpickling ran code from trainer_state.pt"


def test_a_rank_shard_holding_a_code_object_is_refused_and_nothing_runs(tmp_path):
    from lazytrain.train.checkpoint import load_shard, shard_name

    class Rank:
        rank = 3
        world_size = 4

    proof = tmp_path / "code-ran"
    torch.save({"engine": {"rng": {"cpu": torch.get_rng_state()}}, "x": _Payload(proof)},
               tmp_path / shard_name(3))
    with pytest.raises(ckpt.CheckpointError, match="refused to load"):
        load_shard(ckpt.Checkpoint(path=tmp_path, step=1), Rank())
    assert not proof.exists()
    torch.save({"engine": {"rng": {"cpu": torch.get_rng_state()}}}, tmp_path / shard_name(3))
    assert torch.equal(load_shard(ckpt.Checkpoint(path=tmp_path, step=1), Rank())
                       ["engine"]["rng"]["cpu"], torch.get_rng_state())


# --- --resume ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["missing-dir", "no-checkpoint", "no-marker", "cut-file"])
def test_resume_without_a_complete_checkpoint_exits_2_naming_what_is_missing(
        arithmetic_model_dir, tiny_plan, tmp_path, capsys, case):
    run = tmp_path / "run"
    if case != "missing-dir":
        train(tiny_config(arithmetic_model_dir, run, "train.steps=1", "data.num_eval=0"),
              plan=tiny_plan, progress=False)
    newest = ckpt.latest_checkpoint(run).path if case != "missing-dir" else None
    if case == "no-checkpoint":
        shutil.rmtree(run / "checkpoints")
    elif case == "no-marker":
        (newest / ckpt.MARKER).unlink()
    elif case == "cut-file":
        with open(newest / "model.safetensors", "r+b") as fh:
            fh.truncate(100)
    config_before = (run / "config.yaml").read_text() if run.is_dir() else None

    code = main(["train", "--resume", str(run), "--steps", "3", "--no-progress"])
    line = _one_error_line(capsys)
    assert code == 2
    needle = {"missing-dir": f"{run} does not exist",
              "no-checkpoint": "has no checkpoint",
              "no-marker": "COMPLETE marker is missing",
              "cut-file": "model.safetensors is 100 bytes"}[case]
    assert needle in line, line
    assert not (run / "metrics.jsonl").is_file() or _steps(run) == [1]  # nothing trained
    if config_before is not None:
        assert (run / "config.yaml").read_text() == config_before


def test_resume_with_another_model_is_refused_and_config_yaml_is_kept(
        arithmetic_model_dir, tiny_plan, tmp_path, capsys):
    run = tmp_path / "run"
    path = _config_file(tmp_path, arithmetic_model_dir)
    tiny_plan.save(tmp_path / "plan.json")
    assert main(["train", "--config", str(path), "--run-dir", str(run), "--no-progress",
                 "--plan", str(tmp_path / "plan.json")]) == 0
    saved_config = (run / "config.yaml").read_text()
    other = tmp_path / "other_model"
    shutil.copytree(arithmetic_model_dir, other)
    hf = json.loads((other / "config.json").read_text())
    hf["num_hidden_layers"] = 2
    (other / "config.json").write_text(json.dumps(hf))
    capsys.readouterr()

    code = main(["train", "--config", str(_config_file(tmp_path, other, "other.yaml")),
                 "--resume", str(run), "--steps", "3", "--no-progress"])
    line = _one_error_line(capsys)
    assert code == 2 and "model.config_path" in line and str(other) in line
    assert str(arithmetic_model_dir) in line
    assert (run / "config.yaml").read_text() == saved_config
    assert _steps(run) == [1, 2]


def test_same_path_with_a_changed_architecture_is_refused_on_resume(arithmetic_model_dir,
                                                                     tiny_plan, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(arithmetic_model_dir, model)
    run = tmp_path / "run"
    train(tiny_config(model, run, "train.steps=1", "data.num_eval=0"), plan=tiny_plan,
          progress=False)
    hf = json.loads((model / "config.json").read_text())
    hf["intermediate_size"] = 96
    (model / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="another architecture"):
        train(tiny_config(model, run, "train.steps=2", "data.num_eval=0"), resume=True,
              progress=False)


# --- run directories --------------------------------------------------------------------------

def test_a_used_run_dir_is_refused_and_overwrite_starts_clean(arithmetic_model_dir, tiny_plan,
                                                              tmp_path, capsys):
    run = tmp_path / "run"
    tiny_plan.save(tmp_path / "plan.json")
    first = _config_file(tmp_path, arithmetic_model_dir, "a.yaml", steps=3)
    args = ["--run-dir", str(run), "--no-progress", "--plan", str(tmp_path / "plan.json")]
    assert main(["train", "--config", str(first), *args]) == 0
    assert ckpt.latest_checkpoint(run).step == 3
    capsys.readouterr()

    second = _config_file(tmp_path, arithmetic_model_dir, "b.yaml", steps=2, lr=1e-3)
    assert main(["train", "--config", str(second), *args]) == 2
    line = _one_error_line(capsys)
    assert "already holds a run" in line and "--resume" in line and "--overwrite" in line
    assert _steps(run) == [1, 2, 3]

    assert main(["train", "--config", str(second), *args, "--overwrite"]) == 0
    assert _steps(run) == [1, 2]  # not appended to run A's
    assert [c.step for c in ckpt.list_checkpoints(run)] == [2]  # run A's step 3 is gone
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["lr"] == 1e-3
    # the next resume continues run B, with run B's weights
    assert ckpt.latest_checkpoint(run).load_state()["config"]["train"]["lr"] == 1e-3


def test_a_rejected_config_leaves_the_saved_config_yaml(arithmetic_model_dir, tiny_plan,
                                                        tmp_path, capsys):
    run = tmp_path / "run"
    train(tiny_config(arithmetic_model_dir, run, "train.steps=1", "data.num_eval=0"),
          plan=tiny_plan, progress=False)
    before = (run / "config.yaml").read_text()
    # the run's plan was made for micro-batch 2: the plan check rejects micro-batch 3
    assert main(["train", "--resume", str(run), "--steps", "2", "--no-progress",
                 "--set", "train.micro_batch=3"]) == 2
    assert "micro_batch" in _one_error_line(capsys)
    assert (run / "config.yaml").read_text() == before


def test_an_unwritable_run_dir_is_one_line_naming_the_key(arithmetic_model_dir, tiny_plan,
                                                          tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    tiny_plan.save(tmp_path / "plan.json")
    code = main(["train", "--config", str(_config_file(tmp_path, arithmetic_model_dir)),
                 "--run-dir", str(blocker / "run"), "--no-progress",
                 "--plan", str(tmp_path / "plan.json")])
    line = _one_error_line(capsys)
    assert code == 1 and line.startswith("error: train.run_dir: cannot write to ")
    assert str(blocker / "run") in line


# --- validate early ---------------------------------------------------------------------------

def test_a_bad_data_path_is_reported_before_planning_and_loading(arithmetic_model_dir, tmp_path,
                                                                 monkeypatch):
    from lazytrain.train import model_source, setup

    def must_not_run(*args, **kwargs):
        raise AssertionError("reached planning or weight loading")

    monkeypatch.setattr(setup, "make_plan", must_not_run)
    monkeypatch.setattr(model_source, "load_adapter", must_not_run)
    # a hub id downloads there
    monkeypatch.setattr(model_source, "resolve_model_source", must_not_run)
    run = tmp_path / "run"
    cfg = tiny_config(arithmetic_model_dir, run, f"data.path={tmp_path / 'nope.jsonl'}")
    with pytest.raises(FileNotFoundError, match=r"data\.path: .*nope\.jsonl does not exist"):
        train(cfg, progress=False)
    assert not (run / "plan.json").exists() and not (run / "config.yaml").exists()


# --- progress that survives -------------------------------------------------------------------

def test_periodic_checkpoints_by_wall_time_and_by_steps(arithmetic_model_dir, tiny_plan,
                                                        tmp_path):
    from lazytrain.config import TrainConfig

    assert TrainConfig().checkpoint_every_min == 30.0  # the default: on
    now = [0.0]

    def clock():  # every reading is 61 s later: a checkpoint is due after every step
        now[0] += 61.0
        return now[0]

    def runs(name, *sets, clock):
        seen = []

        def on_step_end(step, stats):  # the save of step k lands after this hook of step k
            last = ckpt.latest_checkpoint(tmp_path / name)
            seen.append(last.step if last else None)

        train(tiny_config(arithmetic_model_dir, tmp_path / name, "data.num_eval=0",
                          "train.steps=4", *sets), plan=tiny_plan, progress=False,
              hooks=TrainHooks(on_step_end=on_step_end), clock=clock)
        return seen

    assert runs("minutes", "train.checkpoint_every_min=1", clock=clock) == [None, 1, 2, 3]
    assert runs("steps", "train.checkpoint_every_min=0", "train.checkpoint_every_steps=2",
                clock=time_frozen) == [None, None, 2, 2]
    assert runs("off", "train.checkpoint_every_min=30", clock=time_frozen) == [None] * 4


def time_frozen() -> float:
    return 0.0


def test_ctrl_c_saves_a_checkpoint_and_exits_130_with_one_line(arithmetic_model_dir, tiny_plan,
                                                               tmp_path, capsys, monkeypatch):
    def ctrl_c_at_two(step, stats):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    handler_before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(loop, "train", functools.partial(
        loop.train, hooks=TrainHooks(on_step_end=ctrl_c_at_two)))
    run = tmp_path / "run"
    tiny_plan.save(tmp_path / "plan.json")
    path = _config_file(tmp_path, arithmetic_model_dir, steps=5)
    code = main(["train", "--config", str(path), "--run-dir", str(run), "--no-progress",
                 "--plan", str(tmp_path / "plan.json")])
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    assert [ln for ln in err.splitlines() if ln.startswith("stopped by")] == [
        f"stopped by SIGINT after step 2; checkpoint {run / 'checkpoints' / 'step-000002'}; "
        f"continue with: lazytrain train --resume {run}"]
    assert ckpt.latest_checkpoint(run).step == 2 and _steps(run) == [1, 2]
    assert signal.getsignal(signal.SIGINT) is handler_before  # restored


@pytest.mark.parametrize("where", ["safetensors", "torch.save"])
def test_disk_full_during_a_save_is_one_line_and_the_previous_checkpoint_stays(
        arithmetic_model_dir, tiny_plan, tmp_path, capsys, monkeypatch, where):
    import safetensors.torch

    real_save_file, real_torch_save = safetensors.torch.save_file, torch.save

    def full_disk_on_second(real, exc):
        def save(obj, path, *args, **kwargs):
            if str(path).find(".tmp-step-000002") >= 0:
                with open(path, "wb") as fh:  # a partial file, then the disk is full
                    fh.write(b"\0" * 64)
                raise exc
            return real(obj, path, *args, **kwargs)
        return save

    if where == "safetensors":
        from safetensors import SafetensorError
        monkeypatch.setattr(safetensors.torch, "save_file", full_disk_on_second(
            real_save_file, SafetensorError("Error while serializing: I/O error: No space "
                                            "left on device (os error 28)")))
    else:
        def save(obj, f, *args, **kwargs):  # the disk under the second checkpoint is full
            if ".tmp-step-000002" not in str(getattr(f, "name", f)):
                return real_torch_save(obj, f, *args, **kwargs)
            with open("/dev/full", "wb") as full:
                return real_torch_save(obj, full if hasattr(f, "write") else "/dev/full",
                                       *args, **kwargs)
        monkeypatch.setattr(torch, "save", save)
    run = tmp_path / "run"
    tiny_plan.save(tmp_path / "plan.json")
    path = _config_file(tmp_path, arithmetic_model_dir, steps=3, checkpoint_every_steps=1)
    code = main(["train", "--config", str(path), "--run-dir", str(run), "--no-progress",
                 "--plan", str(tmp_path / "plan.json")])
    line = _one_error_line(capsys)
    assert code == 1 and "saving checkpoint step-000002" in line
    assert "No space left on device" in line and "step-000001 is kept" in line
    assert "the disk is full" in line and "errno 28" in line and " bytes free on " in line
    assert ("writing trainer_state.pt: " if where == "torch.save" else
            "writing the model weights (safetensors): ") in line
    assert ckpt.latest_checkpoint(run).step == 1
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000001"]


# --- bit-identical resume with dropout and evaluation -----------------------------------------

def test_two_plus_two_steps_with_dropout_and_evaluation_equal_four_bit_for_bit(
        arithmetic_model_dir, tiny_plan, tmp_path):
    model = tmp_path / "dropout_model"
    shutil.copytree(arithmetic_model_dir, model)
    hf = json.loads((model / "config.json").read_text())
    hf["attention_dropout"] = 0.1
    (model / "config.json").write_text(json.dumps(hf))
    sets = ("data.num_eval=4", "train.steps=4")
    straight = train(tiny_config(model, tmp_path / "a", *sets), plan=tiny_plan, progress=False)

    def stop_after_two(step, stats):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    train(tiny_config(model, tmp_path / "b", *sets), plan=tiny_plan, progress=False,
          hooks=TrainHooks(on_step_end=stop_after_two))
    resumed = train(tiny_config(model, tmp_path / "b", *sets), resume=True, progress=False)
    assert resumed["steps_this_run"] == 2 and straight["steps_this_run"] == 4

    def records(run):
        return [json.loads(ln) for ln in (tmp_path / run / "metrics.jsonl").read_text()
                .splitlines()]
    a, b = records("a"), records("b")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    wa = load_file(str(ckpt.latest_checkpoint(tmp_path / "a").path / "model.safetensors"))
    wb = load_file(str(ckpt.latest_checkpoint(tmp_path / "b").path / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# --- small ones -------------------------------------------------------------------------------

def test_seq_len_8_ends_in_one_line_not_a_format_error(arithmetic_model_dir, tmp_path, capsys):
    path = _config_file(tmp_path, arithmetic_model_dir)
    code = main(["train", "--config", str(path), "--run-dir", str(tmp_path / "run"),
                 "--no-progress", "--set", "data.seq_len=8", "--set", "data.num_eval=2"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "NoneType" not in err
    assert "eval before" not in err  # refused before the run evaluates or writes a file
    errors = [ln for ln in err.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and "data.seq_len=8" in errors[0]


def test_a_bf16_checkpoint_says_bfloat16_and_carries_a_generation_config(arithmetic_model_dir,
                                                                         tiny_plan, tmp_path):
    from transformers import AutoModelForCausalLM, GenerationConfig

    run = tmp_path / "run"
    train(tiny_config(arithmetic_model_dir, run, "train.steps=1", "data.num_eval=0",
                      "train.master_dtype=bf16", "model.dtype=bf16"), plan=tiny_plan,
          progress=False)
    path = ckpt.latest_checkpoint(run).path
    hf = json.loads((path / "config.json").read_text())
    assert hf.get("dtype", hf.get("torch_dtype")) == "bfloat16"
    assert {t.dtype for t in load_file(str(path / "model.safetensors")).values()} == \
        {torch.bfloat16}
    assert AutoModelForCausalLM.from_pretrained(path, dtype="auto").dtype == torch.bfloat16
    generation = GenerationConfig.from_pretrained(path)
    assert generation.eos_token_id == hf["eos_token_id"]
    # an fp32 run still says float32
    train(tiny_config(arithmetic_model_dir, tmp_path / "fp32", "train.steps=1",
                      "data.num_eval=0"), plan=tiny_plan, progress=False)
    hf32 = json.loads((ckpt.latest_checkpoint(tmp_path / "fp32").path / "config.json")
                      .read_text())
    assert hf32.get("dtype", hf32.get("torch_dtype")) == "float32"


def test_report_json_into_a_closed_pipe_ends_quietly(arithmetic_model_dir, tiny_plan, tmp_path):
    import subprocess
    import sys

    run = tmp_path / "run"
    train(tiny_config(arithmetic_model_dir, run, "train.steps=1", "data.num_eval=0"),
          plan=tiny_plan, progress=False)
    # `lazytrain report RUN --json | head -c 0`: the reader is gone before the first write, so
    # every write fails with EPIPE (deterministic, whatever the output's size)
    proc = subprocess.Popen([sys.executable, "-m", "lazytrain.cli.main", "report", str(run),
                             "--json", "--skip-steps", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert "BrokenPipe" not in err and "Traceback" not in err


def test_a_second_job_in_a_run_directory_in_use_is_refused_before_it_touches_a_file(
        arithmetic_model_dir, tmp_path):
    """`--overwrite` while another job trains there: refused, the running job's files stay."""
    from lazytrain.train import locks

    run_dir = tmp_path / "live"
    run_dir.mkdir()
    for name in ("metrics.jsonl", "config.yaml", "plan.json"):
        (run_dir / name).write_text("the running job's\n")
    (run_dir / "checkpoints" / "step-000700").mkdir(parents=True)
    held = locks.lock_run_dir(run_dir)  # the running job
    try:
        cfg = tiny_config(arithmetic_model_dir, run_dir, "train.steps=1", "data.num_eval=0")
        with pytest.raises(locks.RunDirInUseError, match=f"pid {os.getpid()}"):
            train(cfg, run_dir=run_dir, overwrite=True, progress=False)
    finally:
        held.close()
    for name in ("metrics.jsonl", "config.yaml", "plan.json"):
        assert (run_dir / name).read_text() == "the running job's\n"
    assert (run_dir / "checkpoints" / "step-000700").is_dir()


def test_resume_on_other_data_of_the_same_size_is_refused(arithmetic_model_dir, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    rows = [{"instruction": f"Add {i} and {i}.", "output": f"{2 * i}"} for i in range(12)]
    a.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows[3]["output"] = "wrong"  # one answer differs, same number of samples
    b.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    cfg = tiny_config(arithmetic_model_dir, run_dir, "train.steps=1", "data.num_eval=0",
                      f"data.path={a}")
    train(cfg, progress=False)
    resumed = tiny_config(arithmetic_model_dir, run_dir, "train.steps=2", "data.num_eval=0",
                          f"data.path={b}")
    with pytest.raises(ValueError, match="other data of the same size"):
        train(resumed, resume=True, progress=False)


@pytest.mark.parametrize("override", ["train.micro_batch=1", "data.seq_len=48"])
def test_resume_with_another_batch_shape_is_refused_even_with_a_plan(
        override, arithmetic_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    train(tiny_config(arithmetic_model_dir, run_dir, "train.steps=1", "data.num_eval=4"),
          progress=False)
    key = override.split("=")[0]
    resumed = tiny_config(arithmetic_model_dir, run_dir, "train.steps=2", "data.num_eval=4",
                          override)
    from lazytrain.planner.build import problem_from_config
    from lazytrain.planner.policy import PlannerOptions, plan as plan_problem

    plan = plan_problem(problem_from_config(resumed),  # a plan made for the new shape
                        PlannerOptions(policy="megatrain", megatrain_k=2, lp_bound=False))
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        train(resumed, resume=True, plan=plan, progress=False)


def test_resume_with_another_held_out_size_of_separate_eval_data_goes_on(arithmetic_model_dir,
                                                                          tmp_path):
    """The embedded task draws train and eval apart: num_eval changes only the held-out set."""
    run_dir = tmp_path / "run"
    train(tiny_config(arithmetic_model_dir, run_dir, "train.steps=1", "data.num_eval=4"),
          progress=False)
    summary = train(tiny_config(arithmetic_model_dir, run_dir, "train.steps=2",
                                "data.num_eval=0"), resume=True, progress=False)
    assert summary["steps_completed"] == 2


def test_an_unwritable_or_file_run_dir_is_one_line_naming_the_key(arithmetic_model_dir,
                                                                  tmp_path):
    from lazytrain.train.loop import CheckpointSaveError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cfg = tiny_config(arithmetic_model_dir, blocker, "train.steps=1", "data.num_eval=0")
    with pytest.raises(CheckpointSaveError, match="train.run_dir: cannot write to"):
        train(cfg, run_dir=blocker, progress=False)
