"""scikit-learn estimators and pipelines: skops files (trusted types only) and, when allowed, pickles.

skops never runs code while loading: it rebuilds only types it trusts. Its own defaults cover
scikit-learn's estimators, numpy and builtins; TRUSTED_TYPES adds the compiled internals scikit-learn's
trees, histogram boosting, neighbours and MLPs keep, and the settings' trusted_types may add more. A type
outside them refuses the load, naming it. A pickle runs arbitrary code when loaded, so it loads only with
allow_pickle and a pickle_sha256 equal to the file's: whoever pinned the digest vouched for that file.

Answers are the estimator's own: predict, and predict_proba for a classifier. A forest's or a tree's
predict is the argmax of its predict_proba (scikit-learn computes it so), so those run once.
"""
import logging
from pathlib import Path

import numpy as np

from inferd.classical.config import ClassicalConfig
from inferd.models.errors import ModelLoadError
from inferd.protocol.classical import Feature, TabularSchema, default_features

log = logging.getLogger(__name__)

TRUSTED_TYPES = (
    "sklearn.tree._tree.Tree",
    "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor",
    "sklearn.ensemble._hist_gradient_boosting.binning._BinMapper",
    "sklearn.neighbors._kd_tree.KDTree",
    "sklearn.neighbors._ball_tree.BallTree",
    "sklearn.metrics._dist_metrics.EuclideanDistance64",
    "sklearn.metrics._dist_metrics.ManhattanDistance64",
    "sklearn.metrics._dist_metrics.MinkowskiDistance64",
    "sklearn.neural_network._stochastic_optimizers.AdamOptimizer",
    "sklearn.neural_network._stochastic_optimizers.SGDOptimizer",
    "sklearn._loss.loss.HalfBinomialLoss",
    "sklearn._loss.loss.HalfMultinomialLoss",
    "sklearn._loss.loss.HalfSquaredError",
)


def load_skops(path: Path, config: ClassicalConfig, sha256: str) -> "SklearnPredictor":
    import skops.io as sio
    try:
        found = sio.get_untrusted_types(file=path)
    except Exception as exc:  # a file skops cannot read at all
        raise ModelLoadError(f"{path}: not a readable skops file: {exc}") from None
    trusted = set(TRUSTED_TYPES) | set(config.trusted_types or ())
    untrusted = [t for t in found if t not in trusted]
    if untrusted:
        raise ModelLoadError(f"{path} holds the type {untrusted[0]}, which inferd does not trust"
                             f"{f' (and {len(untrusted) - 1} more)' if len(untrusted) > 1 else ''}; if you "
                             "trust this file, add it to the settings' trusted_types")
    return SklearnPredictor(sio.load(path, trusted=found), config, "skops")


def load_pickle(path: Path, config: ClassicalConfig, sha256: str) -> "SklearnPredictor":
    if not config.allow_pickle:
        raise ModelLoadError(f"{path} is a pickle, which runs arbitrary code when loaded; save the model with "
                             "skops (or ONNX), or set allow_pickle: true and pin its pickle_sha256")
    if config.pickle_sha256 is None:
        raise ModelLoadError(f"{path}: allow_pickle needs pickle_sha256, the digest of the one file you trust")
    if config.pickle_sha256.lower() != sha256:
        raise ModelLoadError(f"{path}: its sha256 is {sha256}, not the pinned pickle_sha256 {config.pickle_sha256}")
    import joblib
    log.warning("loading the pickle %s (sha256 %s, pinned)", path, sha256)
    return SklearnPredictor(joblib.load(path), config, "pickle")


class SklearnPredictor:
    def __init__(self, model, config: ClassicalConfig, format: str):
        import sklearn
        from sklearn.base import is_classifier, is_regressor
        if not hasattr(model, "predict") or not (is_classifier(model) or is_regressor(model)):
            raise ModelLoadError(f"the file holds a {type(model).__name__}, not a scikit-learn classifier or "
                                 "regressor")
        self.model, self.format = model, format
        self.library = f"scikit-learn {sklearn.__version__}"
        jobs = {k: (config.num_threads if config.num_threads > 1 else None)
                for k in model.get_params(deep=True) if k == "n_jobs" or k.endswith("__n_jobs")}
        model.set_params(**jobs)
        _limit_blas(config.num_threads)
        classifier = is_classifier(model)
        names = getattr(model, "feature_names_in_", None)
        self.named = names is not None
        count = getattr(model, "n_features_in_", None)
        if count is None:
            raise ModelLoadError(f"the {type(model).__name__} is not fitted (it has no n_features_in_)")
        features = tuple(Feature(str(n)) for n in names) if self.named else default_features(count, "x")
        classes = tuple(c.item() if hasattr(c, "item") else c for c in model.classes_) if classifier else None
        self.schema = TabularSchema(features, "classifier" if classifier else "regressor", classes)
        self.argmax_is_predict = classifier and _argmax_is_predict(model)

    def predict(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        if self.schema.task == "regressor":
            return self.model.predict(rows), None
        probabilities = self.model.predict_proba(rows)
        if self.argmax_is_predict:
            return self.model.classes_.take(np.argmax(probabilities, axis=1), axis=0), probabilities
        return self.model.predict(rows), probabilities


def _argmax_is_predict(model) -> bool:
    from sklearn.ensemble._forest import ForestClassifier
    from sklearn.pipeline import Pipeline
    from sklearn.tree import BaseDecisionTree
    final = model.steps[-1][1] if isinstance(model, Pipeline) else model
    return isinstance(final, (ForestClassifier, BaseDecisionTree)) and getattr(final, "n_outputs_", 1) == 1


def _limit_blas(threads: int) -> None:
    from threadpoolctl import threadpool_limits
    threadpool_limits(limits=threads)  # for this process: a replica runs one model
