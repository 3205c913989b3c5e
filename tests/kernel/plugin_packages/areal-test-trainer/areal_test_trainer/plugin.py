"""Registrations only (imports nothing but areal_kernel), as the docs ask."""
from areal_kernel import hookimpl


@hookimpl
def areal_register_trainers(register):
    register(
        "count_up",
        "areal_test_trainer.impl:CountUpTrainer",
        config_model="areal_test_trainer.impl:CountUpSettings",
        description="counts from algorithm.count_up.start in steps of algorithm.count_up.increment",
    )
