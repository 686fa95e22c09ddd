"""A resume drops the metric lines of redone steps, also when a crash tore the last line."""

from __future__ import annotations

import json

from lazytrain.train.trainer import _truncate_metrics


def test_a_torn_last_line_is_dropped_with_the_redone_steps(tmp_path):
    path = tmp_path / "windows.jsonl"
    lines = [json.dumps({"step": s, "windows": []}) for s in (1, 2, 3)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 4, "wind')  # killed mid-append
    _truncate_metrics(path, last_step=2)
    assert [json.loads(ln)["step"] for ln in path.read_text().splitlines()] == [1, 2]
    assert not list(tmp_path.glob("*.tmp*"))  # rewritten atomically, no temp file left
