"""Config loading, overrides, validation messages, allocation strings."""
import pytest

from areal_kernel.config import load_config, parse_allocation
from areal_kernel.plugins import get_registry
from areal_kernel.config.allocation import AllocationError
from areal_kernel.config.overrides import apply_overrides, parse_override
from areal_kernel.errors import ConfigError


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_defaults_validate_and_round_trip(tmp_path):
    cfg = load_config(None, registry=get_registry())
    assert cfg.actor.backend == "torch" and cfg.rollout.backend == "embedded"
    import yaml

    again = load_config(write(tmp_path, yaml.safe_dump(cfg.dump())), registry=get_registry())
    assert again.dump() == cfg.dump()


def test_overrides_are_typed():
    parts, v = parse_override("rollout.gconfig.temperature=0.7")
    assert parts == ["rollout", "gconfig", "temperature"] and v == 0.7
    assert parse_override("a=[1, 2]")[1] == [1, 2]
    assert parse_override("a={x: 1}")[1] == {"x": 1}
    assert parse_override("a=true")[1] is True
    assert parse_override("a=null")[1] is None
    assert parse_override("a=1e-5")[1] == 1e-5  # YAML 1.1 would say str
    assert parse_override("a=hello")[1] == "hello"


def test_overrides_apply_to_a_validated_config(tmp_path):
    path = write(tmp_path, "trainer:\n  batch_size: 4\nlogging:\n  sinks: [console]\n")
    cfg = load_config(path, ["trainer.max_steps=7", "logging.sinks=[jsonl, console]", "rollout.max_staleness=0",
                             "dataset.field_map={prompt: question}"], registry=get_registry())
    assert cfg.trainer.batch_size == 4 and cfg.trainer.max_steps == 7
    assert cfg.logging.sinks == ["jsonl", "console"]
    assert cfg.rollout.max_staleness == 0
    assert cfg.dataset.field_map == {"prompt": "question"}


def test_override_into_a_scalar_is_rejected():
    with pytest.raises(ConfigError, match="'experiment_name' is a str, not a section"):
        apply_overrides({"experiment_name": "x"}, ["experiment_name.sub=1"])


def test_list_index_override():
    data = apply_overrides({"logging": {"sinks": ["a", "b"]}}, ["logging.sinks.1=c"])
    assert data["logging"]["sinks"] == ["a", "c"]
    with pytest.raises(ConfigError, match="index 5 out of range"):
        apply_overrides({"s": [1]}, ["s.5=2"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.batch_size", "must look like key.sub=value"),
        ("=3", "must look like key.sub=value"),
        ("trainer..x=1", "empty segment"),
        ("a=[1, 2", "value is not valid YAML"),
    ],
)
def test_bad_override_syntax(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override], registry=get_registry())


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.batch_sise=4", "trainer.batch_sise: unknown key; did you mean 'batch_size'?"),
        ("trainr.batch_size=4", "trainr: unknown key; did you mean 'trainer'?"),
        ("trainer.batch_size=many", "trainer.batch_size: Input should be a valid integer"),
        ("trainer.batch_size=0", "trainer.batch_size: Input should be greater than or equal to 1"),
        ("rollout.max_staleness=-1", "rollout.max_staleness: Input should be greater than or equal to 0"),
        ("model.dtype=float16", "model.dtype: Input should be 'float32' or 'bfloat16'"),
        ("rollout.gconfig.top_p=1.5", "rollout.gconfig.top_p: Input should be less than or equal to 1"),
        ("rollout.max_stalenes=2", "rollout.max_stalenes: unknown key; did you mean 'max_staleness'?"),
        ("experiment_name=a/b", "experiment_name: must be a non-empty name without '/'"),
        ("dataset.type=file", "dataset.path is required when dataset.type is 'file'"),
        ("actor.backend=torch:x2", "actor.backend: 'torch:x2': unknown dimension 'x'"),
        ("actor.backend=torch:", "actor.backend: 'torch:': nothing after ':'"),
    ],
)
def test_config_errors_name_the_field(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override], registry=get_registry())
    assert message in str(e.value)


def test_malformed_yaml_reports_the_line(tmp_path):
    path = write(tmp_path, "trainer:\n  batch_size: 4\n  max_steps: [1, 2\nmodel: {}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, registry=get_registry())
    assert f"{path}:" in str(e.value) and "invalid YAML" in str(e.value)
    line = int(str(e.value).split(":")[1])
    assert 3 <= line <= 4


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="the top level must be a mapping of sections, got list"):
        load_config(write(tmp_path, "- a\n- b\n"), registry=get_registry())


def test_missing_and_directory_config(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "nope.yaml"), registry=get_registry())
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(str(tmp_path), registry=get_registry())


def test_builtin_backend_section_is_validated():
    cfg = load_config(None, ["actor.torch.lr=0.001"], registry=get_registry())
    assert cfg.actor.plugin_config.lr == 0.001
    with pytest.raises(ConfigError, match=r"actor\.torch\.lrr: unknown key; did you mean 'lr'\?"):
        load_config(None, ["actor.torch.lrr=0.001"], registry=get_registry())


@pytest.mark.parametrize(
    "text, expected",
    [
        ("fsdp", dict(backend="fsdp", d=1, t=1)),
        ("fsdp:d2", dict(backend="fsdp", d=2, world_size=2)),
        ("vllm:d2t1", dict(backend="vllm", d=2, t=1, devices_per_replica=1)),
        ("megatron:d2t2p2", dict(backend="megatron", world_size=8)),
        ("my-backend.v2:t4", dict(backend="my-backend.v2", t=4, devices_per_replica=4)),
    ],
)
def test_allocation_parsing(text, expected):
    a = parse_allocation(text)
    for k, v in expected.items():
        assert getattr(a, k) == v


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "non-empty"),
        ("fsdp:d0", "must be >= 1"),
        ("fsdp:d2d2", "given twice"),
        ("fsdp:2d", "cannot parse '2d'"),
        ("fsdp:d2x", "cannot parse 'x'"),
        ("fsdp:q3", "unknown dimension 'q'"),
        ("9fsdp", "not valid"),
    ],
)
def test_bad_allocations(text, message):
    with pytest.raises(AllocationError, match=message):
        parse_allocation(text)


def _settings_nodes(node, found):
    """Every schema node the schema generator marked 'Settings of <kind> '<name>''."""
    if isinstance(node, dict):
        d = node.get("description", "")
        if isinstance(d, str) and d.startswith("Settings of "):
            found[d.split(" (plugin ")[0][len("Settings of ") :]] = node
        for v in node.values():
            _settings_nodes(v, found)
    elif isinstance(node, list):
        for v in node:
            _settings_nodes(v, found)
    return found


def test_schema_holds_every_registered_settings_model():
    """`areal schema` shows each registered config model where its settings
    go, tools included (`workflow.multi_turn.tool_settings.<tool>`), so that
    an editor validating against the schema refuses what `areal validate` refuses."""
    from areal_kernel.config.loader import json_schema
    from areal_kernel.plugins import get_registry
    from areal_kernel.plugins.registry import KINDS

    schema = json_schema(get_registry())
    found = _settings_nodes(schema, {})
    specs = [s for k in KINDS for s in get_registry().specs(k) if s.config_model is not None]
    want = {f"{s.kind} '{s.name}'" for s in specs if s.settings_section is None}
    assert "tool 'calculator'" in want
    assert want - set(found) == set(), "registered settings models missing from the schema"
    # A trainer reading a shared section (ipo: algorithm.dpo) is named on that section's node.
    algorithm = schema["$defs"]["AlgorithmConfig"]["properties"]
    for s in specs:
        if s.settings_section is not None:
            assert f"'{s.name}'" in algorithm[s.settings_section]["description"], s.name
    assert "beta" in algorithm["dpo"]["properties"] and "ipo" not in algorithm
    multi = schema["$defs"]["WorkflowConfig"]["properties"]["multi_turn"]
    tools = multi["properties"]["tool_settings"]
    assert tools["additionalProperties"] is False
    calc = tools["properties"]["calculator"]["properties"]
    assert calc["max_length"]["minimum"] == 1 and calc["max_length"]["default"] == 200


# -- two phases: parse without plugins, resolve against a registry ------------


def _small_registry():
    """A registry filled by hand (no plugin loaded): one factory per selected
    name of a default config, plus an engine and an estimator with settings."""
    from pydantic import BaseModel, ConfigDict

    from areal_kernel.plugins.registry import FactorySpec, Registry

    class EngineSettings(BaseModel):
        model_config = ConfigDict(extra="forbid")
        lr: float = 0.5

    class ClashingSettings(BaseModel):
        gamma: float = 0.9  # a keyword the kernel passes every estimator itself

    reg = Registry()
    names = {
        "train_engine": ["torch", "mine"], "inference_engine": ["embedded"], "dataset": ["arithmetic"],
        "workflow": ["rlvr"], "reward": ["math"], "advantage_estimator": ["grpo", "clashing"], "loss": ["ppo"],
        "trainer": ["grpo"], "metric_sink": ["console", "jsonl", "tensorboard"], "scheduler": ["local"],
    }  # fmt: skip
    models = {("train_engine", "mine"): EngineSettings, ("advantage_estimator", "clashing"): ClashingSettings}
    for kind, kind_names in names.items():
        for name in kind_names:
            reg.add(FactorySpec(kind, name, "probe:target", "probe", config_model=models.get((kind, name))))
    return reg


def test_parsing_checks_the_shape_without_loading_a_plugin():
    # In a fresh process: no plugin module is imported, unknown names parse.
    import json
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from areal_kernel.config import validate_config\n"
        "cfg = validate_config({'actor': {'backend': 'nosuch:d2', 'nosuch': {'x': 1}}, 'reward': {'type': 'nope'},\n"
        "                       'algorithm': {'advantage': 'zzz'}, 'logging': {'sinks': ['none']}})\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('areal_kernel.plugins', 'areal_kernel.builtin')))\n"
        "print(json.dumps([cfg.actor.allocation.d, loaded]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [2, []]


def test_parsing_still_refuses_a_bad_shape():
    from areal_kernel.config import validate_config

    with pytest.raises(ConfigError, match=r"actor\.fsdp: unknown key.*go under actor\.torch"):
        validate_config({"actor": {"backend": "torch", "fsdp": {}}})
    # A scalar is never a settings section: a mistyped algorithm key is refused while parsing.
    with pytest.raises(ConfigError, match=r"algorithm\.eps_clp: unknown key; did you mean 'eps_clip'"):
        validate_config({"algorithm": {"eps_clp": 0.3}})
    with pytest.raises(ConfigError, match=r"logging\.wandb: unknown key"):
        validate_config({"logging": {"sinks": ["console"], "wandb": {}}})


def test_resolve_checks_names_and_settings_against_the_registry_it_is_given():
    from areal_kernel.config import resolve, validate_config

    reg = _small_registry()
    cfg = resolve(validate_config({"actor": {"backend": "mine:d2", "mine": {"lr": 0.1}}}), reg)
    assert cfg.actor.plugin_config.lr == 0.1 and cfg.rollout.plugin_config is None
    # Defaults of a settings model arrive when no section was written.
    assert resolve(validate_config({"actor": {"backend": "mine"}}), reg).actor.plugin_config.lr == 0.5
    # The names the given registry holds, not the process's plugins, decide.
    with pytest.raises(ConfigError, match=r"reward\.type: no reward named 'code_exec'\. Available: math\."):
        resolve(validate_config({"reward": {"type": "code_exec"}}), reg)
    with pytest.raises(ConfigError, match=r"actor\.mine\.lrr: unknown key; did you mean 'lr'"):
        resolve(validate_config({"actor": {"backend": "mine", "mine": {"lrr": 1}}}), reg)
    with pytest.raises(ConfigError, match=r"^src is invalid:\nalgorithm\.loss: no loss named 'vanilla'"):
        resolve(validate_config({"algorithm": {"loss": "vanilla"}}), reg, "src")
    with pytest.raises(ConfigError, match=r"algorithm\.clashing: .* field\(s\) gamma, which the kernel already passes"):
        resolve(validate_config({"algorithm": {"advantage": "clashing"}}), reg)
    # A mapping under algorithm: may be a trainer's shared section (settings_section),
    # which only the registry knows: parsing lets it through, resolving refuses a stray one.
    stray = validate_config({"algorithm": {"gpro": {}}})
    with pytest.raises(ConfigError, match=r"algorithm\.gpro: unknown key; did you mean 'grpo'"):
        resolve(stray, reg)


def test_trainers_may_share_one_settings_section():
    """A trainer's settings come from algorithm.<its name>, or from the
    section it registered as settings_section (the kernel's ipo reads
    algorithm.dpo); another trainer's section is refused, naming it."""
    from pydantic import BaseModel, ConfigDict

    from areal_kernel.config import resolve, validate_config
    from areal_kernel.plugins.registry import FactorySpec

    class PairSettings(BaseModel):
        model_config = ConfigDict(extra="forbid")
        beta: float = 0.1

    reg = _small_registry()
    reg.add(FactorySpec("trainer", "pair_a", "probe:target", "probe", config_model=PairSettings))
    reg.add(
        FactorySpec("trainer", "pair_b", "probe:target", "probe", config_model=PairSettings, settings_section="pair_a")
    )
    for name in ("pair_a", "pair_b"):
        cfg = resolve(validate_config({"algorithm": {"type": name, "pair_a": {"beta": 0.5}}}), reg)
        assert cfg.algorithm.trainer_settings == PairSettings(beta=0.5), name
        assert resolve(validate_config({"algorithm": {"type": name}}), reg).algorithm.trainer_settings.beta == 0.1
    with pytest.raises(ConfigError, match=r"algorithm\.pair_a\.bta: unknown key; did you mean 'beta'"):
        resolve(validate_config({"algorithm": {"type": "pair_b", "pair_a": {"bta": 1}}}), reg)
    with pytest.raises(ConfigError, match=r"algorithm\.pair_b: unknown key.*the trainer 'pair_b' .*algorithm\.pair_a"):
        resolve(validate_config({"algorithm": {"type": "pair_b", "pair_b": {"beta": 1}}}), reg)
    with pytest.raises(
        ConfigError,
        match=r"algorithm\.pair_a: the settings of trainer 'pair_a' / 'pair_b', but algorithm\.type selects 'grpo'",
    ):
        resolve(validate_config({"algorithm": {"type": "grpo", "pair_a": {"beta": 1}}}), reg)


def test_plugin_settings_of_a_parsed_config_are_refused_until_resolved():
    from areal_kernel.config import resolve, validate_config

    cfg = validate_config({"actor": {"backend": "mine", "mine": {"lr": "0.25"}}})
    for read in (
        lambda: cfg.actor.plugin_config,
        lambda: cfg.algorithm.loss_settings,
        lambda: cfg.logging.sink_settings("console"),
        lambda: cfg.scheduler.section("local"),
    ):
        with pytest.raises(ConfigError, match="not resolved against the plugin registry"):
            read()
    resolve(cfg, _small_registry())
    assert cfg.actor.plugin_config.lr == 0.25 and cfg.algorithm.loss_settings is None
    assert cfg.logging.sink_settings("console") is None and cfg.scheduler.section("local") is None
    # A selection changed after resolving reads as unresolved, never as the old name's settings.
    cfg.actor.backend = "torch"
    with pytest.raises(ConfigError, match=r"actor\.torch: the config was parsed but not resolved"):
        cfg.actor.plugin_config
    cfg.algorithm.advantage = "clashing"
    with pytest.raises(ConfigError, match=r"algorithm\.clashing: the config was parsed but not resolved"):
        cfg.algorithm.advantage_settings
    # Resolving again is harmless and picks the new selection up.
    cfg.algorithm.advantage = "grpo"
    assert resolve(cfg, get_registry()).actor.plugin_config.lr > 0  # the built-in torch engine's settings


def test_old_offline_fields_read_as_defaults_with_a_deprecation_warning():
    """sft/dpo/rm were AlgorithmConfig fields; a caller reading one that is not
    the selected trainer's section gets its defaults and is told where to look."""
    from areal_kernel.config import validate_config
    from areal_kernel.config.offline import DPOConfig

    algo = validate_config({"algorithm": {"type": "grpo"}}).algorithm
    with pytest.warns(DeprecationWarning, match=r"AlgorithmConfig\.dpo is deprecated.*trainer_settings"):
        assert algo.dpo == DPOConfig()
    with pytest.raises(AttributeError, match="nosuch"):
        algo.nosuch
