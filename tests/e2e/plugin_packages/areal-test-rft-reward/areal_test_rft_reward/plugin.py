from areal_kernel import hookimpl


@hookimpl
def areal_register_rewards(register):
    register("text_hash", "areal_test_rft_reward.impl:text_hash_reward", description="probe_score of the completion")
