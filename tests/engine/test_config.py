import pytest

from inferd.cli import _parser
from inferd.control.launch import replica_args
from inferd.control.spec import SpecError, build
from inferd.engine.config import EngineConfig
from inferd.settings import config_from, flags_of, scalar, user_settings


def _changed() -> EngineConfig:
    """Every user setting away from its default, so that a setting lost on any path shows."""
    values = {}
    for f in user_settings(EngineConfig):
        kind = scalar(f.type)
        if f.metadata["choices"]:
            values[f.name] = next(c for c in f.metadata["choices"] if c != f.default)
        elif kind is bool:
            values[f.name] = not f.default
        elif kind is str:
            values[f.name] = "layers:2"
        else:
            values[f.name] = kind(3 if f.default is None else f.default * 2 + 1)
    return EngineConfig(**values)


def test_every_setting_differs_in_the_probe():
    changed, defaults = _changed(), EngineConfig()
    assert all(getattr(changed, f.name) != getattr(defaults, f.name) for f in user_settings(EngineConfig))


@pytest.mark.parametrize("command", ["serve", "replica"])
def test_engine_flags_give_the_config_back(command):
    args = _parser().parse_args([command, *flags_of(_changed())])
    assert config_from(EngineConfig, args) == _changed()
    assert config_from(EngineConfig, _parser().parse_args([command])) == EngineConfig()


def test_replica_args_give_the_config_back():
    args = _parser().parse_args(["replica", *replica_args(None, "smol", _changed(), ["--log-format", "json"])])
    assert config_from(EngineConfig, args) == _changed()
    assert (args.model, args.served_model_name, args.log_format) == (None, "smol", "json")


def test_old_flag_names_still_parse():
    args = _parser().parse_args(["replica", "--no-prefix-caching", "--dtype", "float32", "--kv-cache-gib", "0.5",
                                 "--num-kv-blocks", "8", "--speculative-model", "layers:1",
                                 "--num-speculative-tokens", "2", "--scheduling-policy", "fcfs"])
    config = config_from(EngineConfig, args)
    assert not config.enable_prefix_caching and config.dtype == "float32" and config.num_kv_blocks == 8
    assert (config.kv_cache_gib, config.speculative_model, config.scheduling_policy) == (0.5, "layers:1", "fcfs")


def test_every_setting_is_a_spec_runtime_field():
    changed = _changed()
    assert build(EngineConfig, {f.name: getattr(changed, f.name) for f in user_settings(EngineConfig)}, "runtime") == changed
    with pytest.raises(SpecError, match=r"runtime.public_prefixes: unknown field"):
        build(EngineConfig, {"public_prefixes": [[1]]}, "runtime")
    with pytest.raises(SpecError, match=r"runtime.block_size: must be at least 1"):
        build(EngineConfig, {"block_size": 0}, "runtime")
