"""Records with images: file datasets read them (paths relative to the file),
the shapes generator is deterministic, bad input is one DataError naming the
record, and the vision_rlvr workflow renders prompts with the processor."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from areal_kernel.data.images import record_images
from areal_kernel.data.shapes import shapes_records, write_shapes_dataset
from areal_kernel.errors import ConfigError, DataError


def _load_file(path: str):
    from areal_kernel.config.models import DatasetConfig
    from areal_kernel.data.contract import load_dataset
    from areal_kernel.plugins import get_registry

    spec = get_registry().get("dataset", "file")
    cfg = DatasetConfig(type="file", path=path, eval_fraction=0.0)
    return load_dataset(spec, cfg, 0, ("prompt", "answer", "images"), "workflow 'vision_rlvr'")


def _rewrite(path: str, fn) -> None:
    rows = [json.loads(line) for line in open(path)]
    fn(rows)
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


def test_file_dataset_reads_images_relative_to_the_file(tmp_path):
    path = write_shapes_dataset(str(tmp_path / "shapes"), 6, seed=3)
    train, evals = _load_file(path)
    assert len(train) == 6 and evals == []
    for rec in train:
        (img,) = rec["images"]
        assert os.path.isabs(img) and os.path.isfile(img)
    # The same images as the in-memory generator's.
    mem = shapes_records(6, 3)
    assert [record_images(r).digest for r in train] == [record_images(r).digest for r in mem]
    assert mem != shapes_records(6, 4)


def test_missing_image_file_names_the_record(tmp_path):
    path = write_shapes_dataset(str(tmp_path / "shapes"), 4, seed=0)
    _rewrite(path, lambda rows: rows[2].update(images=["images/nope.png"]))
    with pytest.raises(DataError, match=r"record 'shapes:\d+': image 0: image file .*nope.png' does not exist"):
        _load_file(path)


def test_image_count_must_match_the_prompt_markers(tmp_path):
    path = write_shapes_dataset(str(tmp_path / "shapes"), 4, seed=0)
    _rewrite(path, lambda rows: rows[1].update(prompt="Compare <image> with <image>."))
    with pytest.raises(
        DataError, match=r"record 'shapes:\d+': its 'prompt' has 2 <image> marker\(s\) but the record has 1"
    ):
        _load_file(path)


def test_too_large_image_names_the_record(tmp_path):
    from PIL import Image

    path = write_shapes_dataset(str(tmp_path / "shapes"), 4, seed=0)
    big = tmp_path / "shapes" / "images" / "big.png"
    Image.new("RGB", (4200, 4200), (10, 10, 10)).save(big)  # over 4096*4096 pixels, a small file
    _rewrite(path, lambda rows: rows[3].update(images=["images/big.png"]))
    with pytest.raises(DataError, match=r"record 'shapes:\d+': image 0 .*big.png\) is too large: 4200x4200 pixels"):
        _load_file(path)


def test_vision_rlvr_renders_prompts_with_the_processor(vlm_dir, vlm_processor, tmp_path):
    from areal_kernel.api.io import GenerationConfig
    from areal_kernel.models.vision import ImageTensors
    from areal_kernel.workflow.vision import VisionRLVRWorkflow

    wf = VisionRLVRWorkflow(
        tokenizer=vlm_processor.tokenizer,
        gconfig=GenerationConfig(),
        reward_target="x:y",
        reward_pool=SimpleNamespace(),
    )
    rec = shapes_records(1, 0)[0]
    ids, images = wf.prompt(rec)
    per_image = ImageTensors(vlm_dir).tokens_per_image()
    assert per_image == 4
    image_id = vlm_processor.tokenizer.convert_tokens_to_ids("<image>")
    assert ids.count(image_id) == per_image * len(images) == 4
    text = vlm_processor.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\n<fake_token_around_image><global-img><image>")
    assert text.endswith(
        "What colour is the shape? Answer with one word: red, green or blue.<|im_end|>\n<|im_start|>assistant\n"
    )
    # A text model's directory has no image support: one clear error.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="is not a vision-language model"):
        VisionRLVRWorkflow(
            tokenizer=SimpleNamespace(name_or_path=str(tmp_path)),
            gconfig=GenerationConfig(),
            reward_target="x:y",
            reward_pool=SimpleNamespace(),
        )


def test_trajectories_with_images_survive_a_json_checkpoint():
    """Recovery checkpoints store a queued group's images once per prompt and
    restore one shared ImageInputs per prompt."""
    from areal_kernel.api.io import ImageInputs, Trajectory

    im = ImageInputs((shapes_records(1, 0)[0]["images"][0],))
    trajs = [
        Trajectory([1, 2], [0, 1], [0.0, -1.0], [-1, 0], 1.0, images=im),
        Trajectory([1, 3], [0, 1], [0.0, -2.0], [-1, 0], 0.0, images=im),
        Trajectory([4, 5], [0, 1], [0.0, -1.0], [-1, 0], 0.0),
    ]
    table: dict = {}
    state = json.loads(json.dumps({"t": [t.to_state(table) for t in trajs], "images": table}))
    assert len(state["images"]) == 1  # once per prompt, not per sample
    cache: dict = {}
    back = [Trajectory.from_state(s, state["images"], cache) for s in state["t"]]
    assert back[0].images is back[1].images and back[0].images.digest == im.digest
    assert back[0].images.files == im.files and back[2].images is None
    assert [t.logprobs for t in back] == [t.logprobs for t in trajs]
