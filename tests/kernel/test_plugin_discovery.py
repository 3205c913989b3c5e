"""Third-party discovery with real installed plugin packages (healthy, broken,
incompatible), exercised through the real `areal` CLI in fresh processes."""
import json


def _plugins(run_areal, env):
    proc = run_areal("plugins", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    return {p["name"]: p for p in json.loads(proc.stdout)["plugins"]}


def test_areal_plugins_lists_each_plugin_with_its_state(run_areal, plugin_env):
    plugins = _plugins(run_areal, plugin_env)
    assert plugins["builtin"]["status"] == "loaded"
    healthy = plugins["healthy"]
    assert healthy["status"] == "loaded"
    assert healthy["distribution"] == "areal-test-healthy" and healthy["version"] == "1.2.3"
    assert "reward:shout_match" in healthy["registers"] and "train_engine:toy" in healthy["registers"]
    broken = plugins["broken"]
    assert broken["status"] == "failed"
    assert "ModuleNotFoundError" in broken["error"] and "areal_test_broken_missing_dependency" in broken["error"]
    assert "Traceback" in broken["error"]  # the real cause, kept for the user
    inc = plugins["incompatible"]
    assert inc["status"] == "incompatible"
    assert "requires areal-kernel>=99" in inc["error"] and "0.1.0" in inc["error"]


def test_human_listing_keeps_working_with_a_broken_plugin(run_areal, plugin_env):
    proc = run_areal("plugins", env=plugin_env)
    assert proc.returncode == 0
    assert "[failed]" in proc.stdout and "[incompatible]" in proc.stdout and "[loaded]" in proc.stdout


def test_broken_plugin_is_raised_only_when_selected(run_areal, plugin_env, tmp_path):
    ok = run_areal("validate", "/dev/null", env=plugin_env)
    assert ok.returncode == 0, ok.stderr
    proc = run_areal("validate", "/dev/null", "reward.type=broken", env=plugin_env)
    assert proc.returncode == 2
    assert "reward.type: reward 'broken': plugin 'broken' (areal-test-broken 0.0.1) is installed but failed to load" in proc.stderr
    assert "areal_test_broken_missing_dependency" in proc.stderr
    assert "Traceback" not in proc.stderr.split("\n")[0]


def test_incompatible_plugin_is_not_imported(run_areal, plugin_env):
    # Its module raises at import; validating a config that selects it must
    # report the version problem instead.
    proc = run_areal("validate", "/dev/null", "reward.type=incompatible", env=plugin_env)
    assert proc.returncode == 2
    assert "requires areal-kernel>=99" in proc.stderr
    assert "must never be imported" not in proc.stderr


def test_areal_plugins_env_filters(run_areal, plugin_env):
    none = _plugins(run_areal, {**plugin_env, "AREAL_PLUGINS": ""})
    assert none["builtin"]["status"] == "loaded"
    assert {n for n, p in none.items() if p["status"] == "loaded"} == {"builtin"}
    assert none["healthy"]["status"] == "disabled"
    only = _plugins(run_areal, {**plugin_env, "AREAL_PLUGINS": "healthy"})
    assert only["healthy"]["status"] == "loaded" and only["broken"]["status"] == "disabled"


def test_disabled_plugin_is_named_when_selected(run_areal, plugin_env):
    proc = run_areal("validate", "/dev/null", "reward.type=shout_match", env={**plugin_env, "AREAL_PLUGINS": ""})
    assert proc.returncode == 2
    assert "no reward named 'shout_match'" in proc.stderr
    # The repo's own plugins (areal-vllm, areal-fsdp, ...) are installed too: check ours are named.
    line = proc.stderr.split("Plugins disabled by AREAL_PLUGINS: ", 1)[1].split("\n", 1)[0].rstrip(".")
    assert {"broken", "healthy", "incompatible"} <= set(line.split(", "))


def test_strict_mode_fails_fast_naming_the_plugin(run_areal, plugin_env):
    proc = run_areal("validate", "/dev/null", env={**plugin_env, "AREAL_STRICT_PLUGINS": "1", "AREAL_PLUGINS": "broken"})
    assert proc.returncode == 2
    assert "plugin 'broken' (areal-test-broken 0.0.1)" in proc.stderr
    # ...and without strict mode the same set-up is fine
    relaxed = run_areal("validate", "/dev/null", env={**plugin_env, "AREAL_PLUGINS": "broken"})
    assert relaxed.returncode == 0, relaxed.stderr


def test_unknown_name_lists_installed_and_gives_install_hint(run_areal, plugin_env):
    # `make install` installs every plugin of this repository; AREAL_PLUGINS
    # leaves areal-megatron out, as on a machine where it is not installed.
    proc = run_areal(
        "validate", "/dev/null", "actor.backend=megatron:d2", env={**plugin_env, "AREAL_PLUGINS": "fsdp,vllm"}
    )
    assert proc.returncode == 2
    err = proc.stderr
    assert "no train_engine named 'megatron'" in err
    assert "Available: " in err and "torch" in err.split("Available: ", 1)[1]
    assert "pip install areal-megatron" in err


def test_typo_gets_a_suggestion(run_areal, plugin_env):
    proc = run_areal("validate", "/dev/null", "reward.type=shout_mach", env=plugin_env)
    assert proc.returncode == 2
    assert "Did you mean 'shout_match'?" in proc.stderr


def test_third_party_config_section_is_validated_by_its_model(run_areal, plugin_env):
    ok = run_areal("validate", "/dev/null", "actor.backend=toy", "actor.toy.lr=0.5", "--json", env=plugin_env)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["actor"]["toy"] == {"lr": 0.5, "layers": 2}
    bad = run_areal("validate", "/dev/null", "actor.backend=toy", "actor.toy.lr=-1", env=plugin_env)
    assert bad.returncode == 2
    assert "actor.toy.lr: Input should be greater than 0" in bad.stderr
    typo = run_areal("validate", "/dev/null", "actor.backend=toy", "actor.toy.layerz=3", env=plugin_env)
    assert "actor.toy.layerz: unknown key; did you mean 'layers'?" in typo.stderr
    wrong_section = run_areal("validate", "/dev/null", "actor.backend=toy", "actor.tyo.lr=1", env=plugin_env)
    assert "actor.tyo: unknown key; did you mean 'toy'?" in wrong_section.stderr


def test_platform_restricted_factory_names_its_platforms(run_areal, plugin_env):
    proc = run_areal("validate", "/dev/null", "actor.backend=gpu_only", env=plugin_env)
    assert proc.returncode == 2
    assert "train_engine 'gpu_only' (plugin 'healthy') supports platforms cuda, npu; the current platform is 'cpu'" in proc.stderr


def test_schema_includes_third_party_sections(run_areal, plugin_env, tmp_path):
    out = tmp_path / "schema.json"
    proc = run_areal("schema", "-o", str(out), env=plugin_env)
    assert proc.returncode == 0, proc.stderr
    schema = json.loads(out.read_text())
    actor_props = schema["$defs"]["ActorConfig"]["properties"]
    assert actor_props["toy"]["properties"]["lr"]["exclusiveMinimum"] == 0
    assert "torch" in actor_props  # the built-in engine's own section
