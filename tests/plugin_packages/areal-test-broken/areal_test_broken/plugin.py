from areal_kernel import hookimpl
import areal_test_broken_missing_dependency  # noqa: F401  (the failure under test)


@hookimpl
def areal_register_rewards(register):
    register("broken_reward", "areal_test_broken.plugin:nothing")
