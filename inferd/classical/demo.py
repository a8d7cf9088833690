"""The demo classical model `inferd serve` serves: a random forest on scikit-learn's iris data set, trained
here on first use (deterministically, well under a second) into $INFERD_CACHE_DIR/classical/ as a skops
file with its schema beside it (the four measurements, in cm; classes setosa, versicolor, virginica)."""
import json
import logging
import os
from pathlib import Path

from inferd.classical.schema_file import schema_path

log = logging.getLogger(__name__)

DEMO_NAME = "iris-classifier"
DEMO_FILE = "iris-classifier-rf50-v1.skops"  # a new recipe gets a new name: a cached file is never stale
FEATURES = ("sepal_length_cm", "sepal_width_cm", "petal_length_cm", "petal_width_cm")


def cache_dir() -> Path:
    return Path(os.environ.get("INFERD_CACHE_DIR") or Path.home() / ".cache" / "inferd") / "classical"


def demo_model_path() -> Path:
    """The demo model's file, trained and written first if it is not there yet."""
    path = cache_dir() / DEMO_FILE
    if not path.is_file():
        train_demo(path)
    return path


def train_demo(path: Path) -> None:
    import skops.io as sio
    from sklearn.datasets import load_iris
    from sklearn.ensemble import RandomForestClassifier

    log.info("training the demo model %s on scikit-learn's iris data set (first start) into %s", DEMO_NAME, path)
    iris = load_iris()
    labels = iris.target_names[iris.target]
    model = RandomForestClassifier(n_estimators=50, max_depth=5, random_state=0, n_jobs=None)
    model.fit(iris.data, labels)
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = {"features": [{"name": n, "dtype": "float64", "allow_nan": False} for n in FEATURES]}
    _write_atomically(schema_path(path), json.dumps(schema, indent=2).encode())
    _write_atomically(path, sio.dumps(model))  # last: a model file means its schema is there
    log.info("trained %s: %d trees, training accuracy %.3f", DEMO_NAME, len(model.estimators_),
             model.score(iris.data, labels))


def _write_atomically(path: Path, content: bytes) -> None:
    """Two processes training at once both write the same bytes; each renames its own file into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(content)
    os.replace(tmp, path)
