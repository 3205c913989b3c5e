"""Registers one estimator and two losses; imports only areal_kernel."""
from areal_kernel import hookimpl


@hookimpl
def areal_register_advantage_estimators(register):
    register(
        "sign",
        "areal_test_algo.impl:sign_advantages",
        config_model="areal_test_algo.impl:SignSettings",  # algorithm.sign: {scale: ...}
        description="+1 above the group mean, -1 below",
    )


@hookimpl
def areal_register_losses(register):
    register(
        "vanilla_pg",
        "areal_test_algo.impl:vanilla_pg",
        config_model="areal_test_algo.impl:VanillaPGSettings",  # algorithm.vanilla_pg: {pg_coef: ...}
        description="-A * logprob, token mean",
    )
    register(
        "old_pg",
        "areal_test_algo.impl:old_pg",
        config_model="areal_test_algo.impl:VanillaPGSettings",  # algorithm.old_pg: {pg_coef: ...}
        description="vanilla_pg written for the keyword convention before knobs (deprecated)",
    )
