"""Registrations only (imports nothing but areal_kernel), as the docs ask."""
from areal_kernel import hookimpl

_IMPL = "areal_test_contract.impl"


@hookimpl
def areal_register_rewards(register):
    # The docs' own example, verbatim in impl.py.
    register(
        "length_penalty",
        f"{_IMPL}:length_penalty",
        config_model=f"{_IMPL}:LengthPenaltyConfig",
        description="1 for a correct answer, minus per_token per token",
    )
    register(
        "echo_value",
        f"{_IMPL}:echo_value",
        config_model=f"{_IMPL}:EchoValueConfig",
        description="scores reward.echo_value.value (checks the types that arrive)",
    )
    register(
        "scaled",
        f"{_IMPL}:scaled",
        config_model=f"{_IMPL}:ScaledConfig",
        description="scale for a correct answer; scale's default lives only in the config model",
    )


@hookimpl
def areal_register_datasets(register):
    register(
        "contract_data",
        f"{_IMPL}:contract_data",
        config_model=f"{_IMPL}:ContractDataConfig",
        description="records shaped by dataset.contract_data.mode (one case of the dataset contract each)",
    )


@hookimpl
def areal_register_workflows(register):
    register("minimal", f"{_IMPL}:MinimalWorkflow", description="only the documented required workflow members")
    register("inflating", f"{_IMPL}:InflatingWorkflow", description="rewards above its reward calls' scores")
    register("crashy", f"{_IMPL}:CrashyWorkflow", description="every episode raises a plain KeyError (a plugin bug)")
