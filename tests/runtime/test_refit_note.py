"""The re-fitted schedule line of `--resume --steps N` gives advice that can be followed: once
the checkpoint's run finished its schedule, "resume with train.steps=<old> to keep the original
schedule" would train nothing."""

from __future__ import annotations

from lazytrain.runtime.optim import lr_at, refit_note

COSINE = dict(base_lr=1e-3, warmup_steps=0, schedule="cosine", min_lr_ratio=0.1)


def test_a_finished_schedule_is_not_kept_by_resuming_with_its_own_total():
    # 3 of 3 steps done, extended to 5: the original schedule ended at its floor,
    # 0.1 x 1e-3 = 1e-4 (hand value)
    note = refit_note(step=3, old_total=3, new_total=5, **COSINE)
    assert "train.steps=3" not in note
    assert "ended at step 3" in note and "train.schedule=constant" in note
    assert "train.lr=0.0001" in note
    assert lr_at(3, base_lr=1e-4, warmup_steps=0, total_steps=5, schedule="constant",
                 min_lr_ratio=0.1) == 1e-4  # the advice goes on at that rate


def test_a_schedule_in_progress_can_still_be_kept():
    note = refit_note(step=2, old_total=4, new_total=8, **COSINE)
    assert "resume with train.steps=4 to keep the original schedule" in note
