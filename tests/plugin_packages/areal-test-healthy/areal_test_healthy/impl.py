from pydantic import BaseModel, ConfigDict, Field

from areal_kernel.api.engine import TrainEngine
from areal_kernel.platforms import Platform


def shout_match(completion: str, answer: str, **kwargs) -> float:
    return 1.0 if completion.strip().lower() == answer.strip().lower() else 0.0


class ToyEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lr: float = Field(1e-3, gt=0)
    layers: int = Field(2, ge=1)


class ToyEngine(TrainEngine):
    """Registered for the config-validation tests only: built by the kernel
    with the inherited ``from_context`` (``ToyEngine(context.settings)``),
    never trained."""

    def __init__(self, settings=None):
        self.settings = settings

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("the toy engine exists for config-validation tests only")

    initialize = compute_logprobs = train_batch = save_hf = send_weights = _unsupported
    named_weights_for_transfer = save_state = load_state = _unsupported


class TestAccelPlatform(Platform):
    name = "testaccel"
    device_type = "cpu"  # a test double: computes on the host
    dist_backend = "gloo"
    visible_devices_env = "TESTACCEL_VISIBLE_DEVICES"
    ray_resource_name = "TESTACCEL"

    def device_count(self) -> int:
        return 4
