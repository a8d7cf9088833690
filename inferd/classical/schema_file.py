"""A model's schema file: `<model>.schema.json` beside the model file, naming its features and their dtypes."""
import json
from pathlib import Path

from inferd.models.errors import ModelLoadError
from inferd.protocol.classical import Feature


def schema_path(model_path: Path) -> Path:
    return model_path.with_name(model_path.name.rsplit(".", 1)[0] + ".schema.json")


def read_schema_file(path: Path) -> tuple[Feature, ...]:
    try:
        raw = json.loads(path.read_text())
        return tuple(Feature.parse(f) for f in raw["features"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path}: not a schema ({{\"features\": [{{\"name\", \"dtype\"}}, ...]}}): {exc}") from None
