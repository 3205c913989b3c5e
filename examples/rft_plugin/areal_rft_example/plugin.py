"""Registrations only: imports nothing but areal_kernel, as the docs ask."""

from areal_kernel import hookimpl


@hookimpl
def areal_register_trainers(register):
    register(
        "rft",
        "areal_rft_example.impl:RFTTrainer",
        config_model="areal_rft_example.impl:RFTSettings",
        # It runs the inference servers of `rollout:` (areal check dry-runs them, areal plan counts them).
        capabilities=["rollout"],
        description="rejection-sampling fine-tuning: sample, keep what the reward accepts, train on it with NLL",
    )
