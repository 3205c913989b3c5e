"""Image prompts through the embedded server and the torch train engine: the
server's logprobs equal the engine's recompute (with images; without them they
differ), prompt sharing on the server and packing in the engine stay exact,
and a generation interrupted by a weight update resumes with its images."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from areal_kernel.api.engine import WeightUpdateMeta
from areal_kernel.api.io import GenerationConfig, ImageInputs, ModelRequest, Trajectory, TrajectoryBatch
from areal_kernel.engine.torch_engine import TorchTrainEngine
from areal_kernel.testing.waits import embedded_tokens_generated, wait_for_embedded_tokens

from vlm_helpers import image_prompt, png

TOL = 1e-4  # fp32 server vs fp32 engine


@pytest.fixture(scope="module")
def server(vlm_dir, tmp_path_factory):
    from areal_kernel.inference.embedded.launcher import EmbeddedLauncher, EmbeddedServerConfig

    launcher = EmbeddedLauncher(EmbeddedServerConfig(dtype="float32"), run_dir=str(tmp_path_factory.mktemp("vlm-run")))
    try:
        (info,) = launcher.launch(vlm_dir, n_servers=1, devices_per_server=0)
        yield info
    finally:
        launcher.stop()


@pytest.fixture(scope="module")
def engine(vlm_dir):
    e = TorchTrainEngine({"lr": 5e-2, "max_tokens_per_mb": 4096})
    e.initialize(vlm_dir, 10)
    return e


def _client(info):
    from areal_kernel.inference.client import RemoteInferenceEngine
    from areal_kernel.inference.embedded.backend import EmbeddedProtocol

    return RemoteInferenceEngine([info.address], EmbeddedProtocol())


def _trajectory(resp) -> Trajectory:
    return Trajectory.from_response(resp, 1.0)


def _max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def _prompts(processor):
    out = []
    for k, colour in enumerate([(220, 30, 30), (30, 200, 40), (40, 40, 230)]):
        images = ImageInputs(tuple(png(colour, square=4 * j) for j in range(1 + k % 2)))
        out.append((image_prompt(processor, images), images))
    return out


def test_server_logprobs_equal_engine_recompute_for_image_prompts(server, engine, vlm_processor):
    client = _client(server)
    prompts = _prompts(vlm_processor)
    reqs = [
        ModelRequest(ids, GenerationConfig(max_new_tokens=12, seed=100 * p + s), images=images)
        for p, (ids, images) in enumerate(prompts)
        for s in range(2)  # two samples per prompt: the server prefills the prompt once
    ]

    async def run():
        try:
            return await asyncio.gather(*(client.agenerate(r) for r in reqs))
        finally:
            await client.aclose(current_loop_only=True)

    try:
        resps = asyncio.run(run())
    finally:
        client.destroy()
    trajs = [_trajectory(r) for r in resps]
    # One object per prompt, shared by the requests, responses and trajectories of its samples.
    assert all(t.images is r.images for t, r in zip(trajs, reqs))
    assert trajs[0].images is trajs[1].images
    batch = TrajectoryBatch(trajs)
    recomputed = engine.compute_logprobs(batch)  # all six packed into micro-batches together
    for t, r, lp in zip(trajs, resps, recomputed):
        n = len(r.input_ids)
        assert len(r.output_ids) == 12
        assert _max_diff(r.output_logprobs, lp[n:]) < TOL
    # Without its pixels the model scores the same tokens differently: images mattered.
    blind = engine.compute_logprobs(TrajectoryBatch([Trajectory.from_response(resps[0], 1.0)]))[0]
    n0 = len(resps[0].input_ids)
    assert _max_diff(blind[n0:], recomputed[0][n0:]) < TOL  # alone == packed
    same_ids_other_image = Trajectory.from_response(resps[0], 1.0)
    same_ids_other_image.images = prompts[2][1] if len(prompts[2][1]) == 1 else ImageInputs((png((0, 0, 0)),))
    other = engine.compute_logprobs(TrajectoryBatch([same_ids_other_image]))[0]
    assert _max_diff(other[n0:], recomputed[0][n0:]) > 1e-2
    # Prompt sharing is off for image batches (said in docs/vision.md): the
    # model runs on every token although each prompt has two samples.
    assert engine.config.share_prompts
    stats = engine.train_batch(batch, _loss)
    assert stats["n_model_tokens"] == stats["n_tokens"] == sum(len(t.input_ids) for t in trajs)


def test_generation_resumes_with_its_images_after_a_weight_update(server, engine, vlm_processor, tmp_path):
    client = _client(server)
    ids, images = _prompts(vlm_processor)[1]
    req = ModelRequest(ids, GenerationConfig(max_new_tokens=300, seed=7), images=images)
    start = embedded_tokens_generated(server.address)
    try:
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(asyncio.run, _generate(client, req))
            wait_for_embedded_tokens(server.address, 5, since=start)
            client.pause()
            # One step on this prompt's own tokens, then the servers load the new weights.
            t = Trajectory(ids + [5] * 4, [0] * len(ids) + [1] * 4, [0.0] * (len(ids) + 4), [-1] * (len(ids) + 4), 1.0)
            t.images = images
            engine.train_batch(TrajectoryBatch([t]), _loss)
            engine.send_weights(WeightUpdateMeta(kind="disk", version=1, path=str(tmp_path / "v1")))
            client.update_weights(WeightUpdateMeta(kind="disk", version=1, path=str(tmp_path / "v1")))
            client.resume()
            resp = fut.result(timeout=300)
    finally:
        client.destroy()
    assert resp.n_interruptions >= 1 and set(resp.output_versions) == {0, 1}
    k = resp.output_versions.index(1)
    recomputed = engine.compute_logprobs(TrajectoryBatch([_trajectory(resp)]))[0][len(ids) :]
    assert _max_diff(resp.output_logprobs[k:], recomputed[k:]) < TOL


def test_bad_image_requests_get_one_clear_error(server, vlm_processor):
    from areal_kernel.errors import ServerError

    client = _client(server)
    ids, images = _prompts(vlm_processor)[1]  # two images
    try:
        for req, needle in (
            (
                ModelRequest(ids, GenerationConfig(max_new_tokens=2), images=ImageInputs((images.files[0],))),
                "placeholder",
            ),
            (ModelRequest(ids, GenerationConfig(max_new_tokens=2)), "no images"),
            (
                ModelRequest(ids, GenerationConfig(max_new_tokens=2), images=ImageInputs((b"not a png", b"x"))),
                "not a readable image",
            ),
        ):
            with pytest.raises(ServerError, match=needle):
                asyncio.run(_generate(client, req))
    finally:
        client.destroy()


async def _generate(client, req):
    try:
        return await client.agenerate(req)
    finally:
        await client.aclose(current_loop_only=True)


def _loss(logprobs, entropy, data):
    return -(logprobs * data["loss_mask"]).sum() / data["batch_loss_tokens"], {}
