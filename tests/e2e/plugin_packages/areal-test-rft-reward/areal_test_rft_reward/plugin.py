from areal_kernel import hookimpl


@hookimpl
def areal_register_rewards(register):
    register("text_hash", "areal_test_rft_reward.impl:text_hash_reward", description="probe_score of the completion")
    register(
        "slow_char_share", "areal_test_rft_reward.impl:slow_char_share_reward",
        description="char_share after a fixed wait (a slow rollout)",
    )
