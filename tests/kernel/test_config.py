"""Config loading, overrides, validation messages, allocation strings."""
import pytest

from areal_kernel.config import load_config, parse_allocation
from areal_kernel.config.allocation import AllocationError
from areal_kernel.config.overrides import apply_overrides, parse_override
from areal_kernel.errors import ConfigError


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_defaults_validate_and_round_trip(tmp_path):
    cfg = load_config(None)
    assert cfg.actor.backend == "torch" and cfg.rollout.backend == "embedded"
    import yaml

    again = load_config(write(tmp_path, yaml.safe_dump(cfg.dump())))
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
                             "dataset.field_map={prompt: question}"])
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
        load_config(None, [override])


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
        load_config(None, [override])
    assert message in str(e.value)


def test_malformed_yaml_reports_the_line(tmp_path):
    path = write(tmp_path, "trainer:\n  batch_size: 4\n  max_steps: [1, 2\nmodel: {}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert f"{path}:" in str(e.value) and "invalid YAML" in str(e.value)
    line = int(str(e.value).split(":")[1])
    assert 3 <= line <= 4


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="the top level must be a mapping of sections, got list"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_missing_and_directory_config(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(str(tmp_path))


def test_builtin_backend_section_is_validated():
    cfg = load_config(None, ["actor.torch.lr=0.001"])
    assert cfg.actor.plugin_config.lr == 0.001
    with pytest.raises(ConfigError, match=r"actor\.torch\.lrr: unknown key; did you mean 'lr'\?"):
        load_config(None, ["actor.torch.lrr=0.001"])


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
    from areal_kernel.plugins.registry import KINDS, get_registry

    schema = json_schema()
    found = _settings_nodes(schema, {})
    want = {f"{k} '{s.name}'" for k in KINDS for s in get_registry().specs(k) if s.config_model is not None}
    assert "tool 'calculator'" in want
    assert want - set(found) == set(), "registered settings models missing from the schema"
    multi = schema["$defs"]["WorkflowConfig"]["properties"]["multi_turn"]
    tools = multi["properties"]["tool_settings"]
    assert tools["additionalProperties"] is False
    calc = tools["properties"]["calculator"]["properties"]
    assert calc["max_length"]["minimum"] == 1 and calc["max_length"]["default"] == 200
