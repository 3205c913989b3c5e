"""load_records on real files through HF datasets, and every DataError message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_kernel.data import load_records
from areal_kernel.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[2]
ROWS = [
    {"question": "What is 1 + 1?", "solution": "2", "level": 1},
    {"question": "What is 2 + 5?", "solution": "7", "level": 2},
    {"question": "What is 9 + 9?", "solution": "18", "level": 3},
]
MAP = {"question": "prompt", "solution": "answer"}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def expected(prefix: str) -> list[dict]:
    return [
        {"prompt": r["question"], "answer": r["solution"], "level": r["level"], "id": f"{prefix}:{i}"}
        for i, r in enumerate(ROWS)
    ]


def test_jsonl_with_field_map_and_generated_ids(tmp_path):
    f = write_jsonl(tmp_path / "math.jsonl", ROWS)
    assert load_records(str(f), field_map=MAP, required=["prompt", "answer"]) == expected("math.jsonl")


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), f)
    assert load_records(str(f), field_map=MAP, required=["prompt", "answer"]) == expected("math.parquet")


def test_csv(tmp_path):
    f = tmp_path / "math.csv"
    f.write_text(
        "question,solution,level\n" + "".join(f'"{r["question"]}",{r["solution"]},{r["level"]}\n' for r in ROWS)
    )
    recs = load_records(str(f), field_map=MAP)
    assert [r["prompt"] for r in recs] == [r["question"] for r in ROWS]
    # CSV types the answer column as integers; answers come back as text.
    assert [r["answer"] for r in recs] == [r["solution"] for r in ROWS]
    assert [r["level"] for r in recs] == [1, 2, 3]
    assert [r["id"] for r in recs] == ["math.csv:0", "math.csv:1", "math.csv:2"]


def test_json_array(tmp_path):
    f = tmp_path / "math.json"
    f.write_text(json.dumps(ROWS))
    assert load_records(str(f), field_map=MAP) == expected("math.json")


def test_rewritten_file_is_read_again(tmp_path):
    # datasets caches by fingerprint; an edited file must not return stale rows.
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "aaa"}])
    assert load_records(str(f))[0]["prompt"] == "aaa"
    write_jsonl(f, [{"prompt": "bbb"}])
    assert load_records(str(f))[0]["prompt"] == "bbb"


def test_ids_from_data_are_kept_as_strings(tmp_path):
    rows = [{"id": 10 + i, "prompt": p} for i, p in enumerate(["a", "b"])]
    recs = load_records(str(write_jsonl(tmp_path / "d.jsonl", rows)))
    assert [r["id"] for r in recs] == ["10", "11"]


def test_limit_keeps_the_first_records(tmp_path):
    f = write_jsonl(tmp_path / "math.jsonl", ROWS)
    assert load_records(str(f), field_map=MAP, limit=2) == expected("math.jsonl")[:2]
    with pytest.raises(ConfigError, match="limit"):
        load_records(str(f), field_map=MAP, limit=0)


def test_directory_splits(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "t0"}, {"prompt": "t1"}])
    write_jsonl(tmp_path / "test.jsonl", [{"prompt": "e0"}])
    train = load_records(str(tmp_path))
    test = load_records(str(tmp_path), split="test")
    assert [r["prompt"] for r in train] == ["t0", "t1"] and [r["prompt"] for r in test] == ["e0"]
    base = tmp_path.name
    assert [r["id"] for r in train] == [f"{base}:train:0", f"{base}:train:1"]
    assert test[0]["id"] == f"{base}:test:0"  # no clash with train ids
    with pytest.raises(DataError, match=r"no split 'validation'.*\['test', 'train'\]"):
        load_records(str(tmp_path), split="validation")


def test_single_file_has_only_train(tmp_path):
    f = write_jsonl(tmp_path / "math.jsonl", ROWS)
    with pytest.raises(DataError, match=r"math\.jsonl.*single split 'train', not 'test'"):
        load_records(str(f), split="test", field_map=MAP)


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=r"nope\.jsonl.*does not exist"):
        load_records(str(missing))


# A file whose content the loader refuses: the error names the file and what is wrong.
@pytest.mark.parametrize(
    "name, content, message",
    [
        ("data.txt", "hello\n", r"data\.txt.*unsupported extension '\.txt'.*\.jsonl"),
        ("bad.jsonl", '{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": oops}\n{"prompt": "d"}\n',
         r"bad\.jsonl.*line 3 is not valid JSON"),
        ("list.jsonl", '{"prompt": "a"}\n[1, 2]\n', r"list\.jsonl.*line 2 is a JSON list, expected an object"),
    ],
    ids=["unsupported-extension", "malformed-jsonl-line", "jsonl-line-not-an-object"],
)  # fmt: skip
def test_unreadable_file_is_named(tmp_path, name, content, message):
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(DataError, match=message):
        load_records(str(f))


@pytest.mark.parametrize(
    "name,content", [("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("header.csv", "prompt,answer\n")]
)
def test_empty_files(tmp_path, name, content):
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(DataError, match=rf"{name.replace('.', '[.]')}.*empty"):
        load_records(str(f))


def test_missing_required_field_lists_present_fields(tmp_path):
    f = write_jsonl(tmp_path / "math.jsonl", ROWS)
    with pytest.raises(DataError) as err:
        load_records(str(f))
    msg = str(err.value)
    assert "math.jsonl" in msg and "['prompt']" in msg
    for field in ("question", "solution", "level"):
        assert field in msg
    assert "field_map" in msg


def test_field_map_source_must_exist(tmp_path):
    f = write_jsonl(tmp_path / "math.jsonl", ROWS)
    with pytest.raises(
        DataError, match=r"field_map.*\['problem'\].*fields present: \['question', 'solution', 'level'\]"
    ):
        load_records(str(f), field_map={"problem": "prompt"})


def test_field_map_target_clash(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "question": "b"}])
    with pytest.raises(DataError, match=r"target\(s\) \['prompt'\] already exist"):
        load_records(str(f), field_map={"question": "prompt"})
    # Swapping is fine when the existing field is mapped away as well.
    recs = load_records(str(f), field_map={"question": "prompt", "prompt": "original"})
    assert recs[0]["prompt"] == "b" and recs[0]["original"] == "a"


def test_record_with_empty_required_field(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": ""}, {"prompt": "c"}])
    with pytest.raises(DataError, match=r"d\.jsonl.*record 1 has an empty or missing 'prompt'"):
        load_records(str(f))
    g = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(DataError, match=r"record 1 has an empty or missing 'answer'"):
        load_records(str(g), required=["prompt", "answer"])


def test_duplicate_ids(tmp_path):
    f = write_jsonl(
        tmp_path / "d.jsonl", [{"id": "x", "prompt": "a"}, {"id": "y", "prompt": "b"}, {"id": "x", "prompt": "c"}]
    )
    with pytest.raises(DataError, match=r"records 0 and 2 both have id 'x'"):
        load_records(str(f))


def test_messages_field(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}], "answer": "1"}]
    recs = load_records(str(write_jsonl(tmp_path / "chat.jsonl", rows)), required=["messages"])
    assert recs[0]["messages"] == [{"role": "user", "content": "hi"}] and recs[0]["id"] == "chat.jsonl:0"


def test_hub_dataset_offline_fails_with_advice(tmp_path):
    # A real process with the Hub unreachable (offline mode), as on these machines.
    code = (
        "from areal_kernel.data import load_records\n"
        "from areal_kernel.errors import DataError\n"
        "try:\n"
        "    load_records('areal-test-owner/no-such-dataset')\n"
        "except DataError as e:\n"
        "    print('DataError:', e)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    env["HF_HOME"] = str(tmp_path / "hf")  # empty cache: nothing to fall back on
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "DataError:" in out.stdout
    assert "'areal-test-owner/no-such-dataset' could not be fetched" in out.stdout
    assert "A local file works" in out.stdout
