"""Data through `datasets`: local Parquet/Arrow/CSV files, folders, saved datasets, split
selection, and Hub ids from a pre-populated cache with HF_DATASETS_OFFLINE (no network).

The reference is always the rows the test wrote, compared with the converted examples.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from lazytrain.data.formats import read_dataset
from lazytrain.data.sources import load_table, looks_like_hub_id

ROWS = [{"question": f"Sam has {i} pens and buys 2. How many?", "answer": f"{i} + 2\n#### {i + 2}"}
        for i in range(6)]


def _expected(rows):
    return [(r["question"], r["answer"], r["answer"].rsplit("#### ", 1)[1]) for r in rows]


def _got(examples):
    return [(ex.messages[0].content, ex.messages[1].content, ex.answer) for ex in examples]


def _write(kind: str, tmp_path):
    """ROWS stored as `kind` with pyarrow / datasets' writers, not with our code."""
    import datasets
    import pyarrow as pa
    import pyarrow.csv
    import pyarrow.parquet

    table = pa.Table.from_pylist(ROWS)
    if kind == "parquet":
        pyarrow.parquet.write_table(table, tmp_path / "d.parquet")
        return tmp_path / "d.parquet"
    if kind == "csv":
        pyarrow.csv.write_csv(table, tmp_path / "d.csv")
        return tmp_path / "d.csv"
    if kind == "arrow":
        with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return tmp_path / "d.arrow"
    if kind == "save_to_disk":
        datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(
            str(tmp_path / "saved"))
        return tmp_path / "saved"
    folder = tmp_path / "folder"  # JSONL files, one per split
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (folder / "test.jsonl").write_text(json.dumps({"question": "t?", "answer": "#### 1"}) + "\n")
    return folder


@pytest.mark.parametrize("kind", ["parquet", "arrow", "csv", "save_to_disk", "folder"])
def test_local_files_and_folders_of_every_kind_read_as_the_rows_written(kind, tmp_path):
    examples, fmt = read_dataset(_write(kind, tmp_path))
    assert fmt == "gsm8k"  # detected from the column names
    assert _got(examples) == _expected(ROWS)


def test_split_selects_a_folder_file_and_slices(tmp_path):
    folder = _write("folder", tmp_path)
    (test,), _ = read_dataset(folder, split="test")
    assert test.messages[0].content == "t?" and test.answer == "1"
    assert _got(read_dataset(folder, split="train[2:4]")[0]) == _expected(ROWS[2:4])


def test_an_unknown_split_names_data_split(tmp_path):
    with pytest.raises(ValueError, match=r"^data.split: 'validation' is not a split of"):
        load_table(_write("folder", tmp_path), split="validation")


def test_a_missing_column_for_the_chosen_format_names_it(tmp_path):
    path = _write("parquet", tmp_path)
    with pytest.raises(ValueError, match=r"column 'instruction' is missing .*'answer', "
                                         r"'question'"):
        read_dataset(path, "alpaca")


@pytest.mark.parametrize("path, hub", [("openai/gsm8k", True), ("gsm8k", True),
                                       ("data/train.jsonl", False), ("/abs/dir", False),
                                       ("x.parquet", False)])
def test_hub_ids_are_told_from_local_paths(path, hub):
    assert looks_like_hub_id(path) is hub


def test_a_missing_local_file_is_not_taken_for_a_hub_id(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.path: .*nope.jsonl does not exist"):
        load_table(tmp_path / "nope.jsonl")


OFFLINE_SCRIPT = textwrap.dedent("""
    import json, sys
    from lazytrain.config import DataConfig
    from lazytrain.data import build_data
    from lazytrain.data.formats import read_dataset
    from lazytrain.data.registry import read_registry_dataset
    from lazytrain.data.tiny_tokenizer import train_tokenizer

    out = {}
    ex, fmt = read_dataset("openai/gsm8k", subset="main", split="test")
    out["test"] = [[e.messages[0].content, e.messages[1].content, e.answer] for e in ex]
    out["fmt"] = fmt
    tok = train_tokenizer(["Sam has pens and buys #### 0123456789"], vocab_size=300)
    data = build_data(DataConfig(path="openai/gsm8k", subset="main", eval_split="test",
                                 num_eval=1), tok, micro_batch=1, seed=0)
    out["bundle"] = [len(data.train.examples), [e.answer for e in data.eval_examples]]
    meta, _ = read_registry_dataset(sys.argv[1], "metamath")
    out["metamath"] = [[m.messages[0].content, m.messages[1].content] for m in meta]
    try:
        read_dataset("openai/not_cached")
    except FileNotFoundError as exc:
        out["error"] = str(exc)
    try:
        read_dataset("openai/gsm8k", subset="socratic")
    except ValueError as exc:
        out["subset_error"] = str(exc)
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.slow
def test_hub_ids_and_hub_registry_entries_load_from_the_cache_offline(tmp_path, shared_dir,
                                                                     populate_hub_cache):
    cache = tmp_path / "cache"
    test_rows = ROWS[:2]
    populate_hub_cache(cache, "openai/gsm8k", "main", {"train": ROWS, "test": test_rows},
                       work_dir=tmp_path / "g")
    meta_rows = [{"query": "What is 1+1?", "response": "2\nThe answer is: 2", "type": "x"}]
    populate_hub_cache(cache, "meta-math/MetaMathQA", "default", {"train": meta_rows},
                       work_dir=tmp_path / "m")
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache),
           "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    registry = shared_dir / "megatrain_configs" / "dataset_info.json"  # metamath: hf_hub_url
    res = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT, str(registry)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.split("RESULT", 1)[1])
    assert out["fmt"] == "gsm8k"
    assert [tuple(t) for t in out["test"]] == _expected(test_rows)
    assert out["bundle"] == [len(ROWS), [_expected(test_rows)[0][2]]]
    assert out["metamath"] == [[meta_rows[0]["query"], meta_rows[0]["response"]]]
    assert "'openai/not_cached' is not in the datasets cache" in out["error"]
    assert "HF_DATASETS_OFFLINE is set" in out["error"] and str(cache) in out["error"]
    assert out["subset_error"].startswith("data.subset: 'socratic' does not select a "
                                          "configuration of openai/gsm8k")
    assert "'main'" in out["subset_error"]  # the cached configurations are listed


def test_plan_with_a_hub_dataset_loads_neither_datasets_nor_torch(repo_root):
    code = ("import sys; from lazytrain.cli.main import main; "
            f"rc = main(['plan', '--policy', 'megatrain', '--config', "
            f"{str(repo_root / 'configs' / 'tiny-llama-cpu.yaml')!r}, "
            "'--set', 'data.path=openai/gsm8k', '--set', 'data.subset=main']); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'datasets')]; "
            "print(bad); sys.exit(rc or (3 if bad else 0))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-500:] + res.stderr[-2000:]
