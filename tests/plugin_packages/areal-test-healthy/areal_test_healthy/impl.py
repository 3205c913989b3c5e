from pydantic import BaseModel, ConfigDict, Field

from areal_kernel.platforms import Platform


def shout_match(completion: str, answer: str, **kwargs) -> float:
    return 1.0 if completion.strip().lower() == answer.strip().lower() else 0.0


class ToyEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lr: float = Field(1e-3, gt=0)
    layers: int = Field(2, ge=1)


class ToyEngine:
    def __init__(self, config=None, backend_config=None, allocation=None):
        self.backend_config = backend_config


class TestAccelPlatform(Platform):
    name = "testaccel"
    device_type = "cpu"  # a test double: computes on the host
    dist_backend = "gloo"
    visible_devices_env = "TESTACCEL_VISIBLE_DEVICES"
    ray_resource_name = "TESTACCEL"

    def device_count(self) -> int:
        return 4
