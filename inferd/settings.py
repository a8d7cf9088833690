"""Settings written once: a config dataclass's fields, with their help, make its command-line flags, its keys
in a deployment spec and the arguments a replica process is started with (engine, embedding, ... configs).
A list-valued field is JSON on the command line (`--features '[{"name": "x"}]'`) and a YAML list in a spec."""
import argparse
import json
import types
import typing
from dataclasses import Field, field, fields


class SettingError(ValueError):
    """A setting that cannot be honoured; .name names it."""

    def __init__(self, name: str, problem: str):
        super().__init__(f"{name}: {problem}")
        self.name, self.problem = name, problem


def setting(default, help: str, choices: tuple[str, ...] = (), metavar: str | None = None):
    return field(default=default, metadata={"help": help, "choices": choices, "metavar": metavar})


def user_settings(cls: type) -> list[Field]:
    """The fields a user sets; those with metadata setting=False are set by code."""
    return [f for f in fields(cls) if f.metadata.get("setting", True)]


def check_choices(config) -> None:
    for f in user_settings(type(config)):
        if f.metadata.get("choices") and getattr(config, f.name) not in f.metadata["choices"]:
            raise SettingError(f.name, f"must be one of {', '.join(f.metadata['choices'])}; "
                               f"got {getattr(config, f.name)!r}")


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    for f in user_settings(cls):
        help = f.metadata["help"] + ("" if f.default is None else " (default: %(default)s)")
        if f.type is bool:
            parser.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=f.default, help=help)
        else:
            parser.add_argument(_flag(f.name), dest=f.name, type=_parse_json if _is_list(f.type) else scalar(f.type),
                                default=f.default,
                                choices=f.metadata["choices"] or None, metavar=f.metadata["metavar"], help=help)


def config_from(cls: type, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in user_settings(cls)})


def flags_of(config) -> list[str]:
    """The flags that give `config` back when parsed by add_flags' parser (defaults left out)."""
    out = []
    for f in user_settings(type(config)):
        value = getattr(config, f.name)
        if value == f.default:
            continue
        if f.type is bool:
            out.append(_flag(f.name) if value else f"--no-{_flag(f.name)[2:]}")
        else:
            out += [_flag(f.name), json.dumps(value) if _is_list(f.type) else str(value)]
    return out


def scalar(hint) -> type:
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return next(t for t in options if t is not type(None))


def _is_list(hint) -> bool:
    return typing.get_origin(scalar(hint)) is list


def _parse_json(text: str):
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError("expected a JSON list")
    return value


def _flag(name: str) -> str:
    return "--" + name.removeprefix("enable_").replace("_", "-")
