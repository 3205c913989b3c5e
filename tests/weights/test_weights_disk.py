"""save_state_dict_dir / load_state_dict_dir on real files."""
from __future__ import annotations

import json
import os

import pytest
import torch

from areal_kernel.errors import DataError
from areal_kernel.weights.disk import load_state_dict_dir, read_shapes, save_state_dict_dir


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(64, 32, generator=g)),  # 8192 B
        ("b.weight", torch.randn(16, generator=g).to(torch.bfloat16)),  # 32 B
        ("c.ids", torch.arange(1000, dtype=torch.int64)),  # 8000 B
        ("d.mask", torch.tensor([True, False, True])),
        ("e.half", torch.randn(3, 5, generator=g).half()),
    ]


def test_round_trip_single_file(tmp_path):
    d = str(tmp_path / "w")
    names = save_state_dict_dir(_tensors(), d)
    assert names == ["model.safetensors"]
    assert sorted(os.listdir(d)) == ["model.safetensors"]
    got = load_state_dict_dir(d)
    for name, t in _tensors():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)


def test_sharding_and_index(tmp_path):
    d = str(tmp_path / "w")
    # a (8192 B) fits in 8200; + b (32 B) = 8224 > 8200 -> second shard, where
    # b + c (8000) + d (3) + e (30) = 8065 fits: 2 shards.
    names = save_state_dict_dir(_tensors(), d, shard_bytes=8200)
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    assert index["weight_map"]["a.weight"] == names[0]
    assert {index["weight_map"][k] for k in ("b.weight", "c.ids", "d.mask", "e.half")} == {names[1]}
    assert index["metadata"]["total_size"] == 8192 + 32 + 8000 + 3 + 30
    got = load_state_dict_dir(d)
    assert set(got) == {n for n, _ in _tensors()}
    assert all(torch.equal(got[n], t) for n, t in _tensors())
    assert read_shapes(d)["a.weight"] == ("F32", [64, 32])


def test_overwrite_keeps_config_and_leaves_no_temp_dirs(tmp_path):
    d = tmp_path / "w"
    save_state_dict_dir(_tensors(), str(d), shard_bytes=8200)
    (d / "config.json").write_text('{"x": 1}')
    new = [("only.weight", torch.ones(2, 2))]
    save_state_dict_dir(new, str(d))
    assert sorted(os.listdir(d)) == ["config.json", "model.safetensors"]  # old shards and index gone
    assert (d / "config.json").read_text() == '{"x": 1}'
    assert list(load_state_dict_dir(str(d))) == ["only.weight"]
    assert os.listdir(tmp_path) == ["w"]


def test_tied_tensors_sharing_storage_are_saved(tmp_path):
    w = torch.randn(8, 4)
    save_state_dict_dir([("embed.weight", w), ("lm_head.weight", w)], str(tmp_path / "w"))
    got = load_state_dict_dir(str(tmp_path / "w"))
    assert torch.equal(got["embed.weight"], w) and torch.equal(got["lm_head.weight"], w)


def test_no_pickle_files(tmp_path):
    save_state_dict_dir(_tensors(), str(tmp_path / "w"), shard_bytes=100)
    for f in os.listdir(tmp_path / "w"):
        assert f.endswith((".safetensors", ".json"))


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(DataError, match="twice"):
        save_state_dict_dir([("x", torch.ones(1)), ("x", torch.ones(1))], str(tmp_path / "a"))
    with pytest.raises(DataError, match="no tensors"):
        save_state_dict_dir([], str(tmp_path / "b"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with pytest.raises(DataError, match="does not exist"):
        load_state_dict_dir(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no \\*.safetensors"):
        load_state_dict_dir(str(tmp_path / "empty"))
    assert sorted(os.listdir(tmp_path)) == ["empty"]  # no temp dirs left behind
