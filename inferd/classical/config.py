"""A classical replica's settings, written once: the fields (with their help) make its flags and spec keys."""
from dataclasses import dataclass

from inferd.protocol.classical import Feature
from inferd.settings import SettingError, setting


@dataclass(slots=True)
class ClassicalConfig:
    max_batch_rows: int = setting(512, "rows per model batch (a request with more is run in pieces of this size)")
    max_queue_delay_ms: float = setting(1.0, "after a busy batch, how long the next may wait to fill, from its "
                                        "oldest request's arrival; an idle model starts at once")
    max_queue_rows: int = setting(65536, "rows waiting at most; beyond: 503 with Retry-After")
    max_queue_requests: int = setting(4096, "requests (or pieces of one) waiting at most; beyond: 503")
    num_threads: int = setting(1, "threads one prediction runs on (onnxruntime intra-op, XGBoost and LightGBM "
                               "nthread, scikit-learn n_jobs and BLAS); more replicas scale better than threads "
                               "at small batches")
    features: list[dict] | None = setting(None, "the input schema, for formats that do not name their "
                                          "features: a JSON list of {name, dtype, allow_nan} (default: "
                                          "MODEL.schema.json beside the model, else the file's own names)",
                                          metavar="JSON")
    allow_pickle: bool = setting(False, "load a pickle/joblib file (it runs arbitrary code when loaded); needs "
                                 "pickle_sha256 too")
    pickle_sha256: str | None = setting(None, "the sha256 a pickle/joblib file must have to be loaded")
    trusted_types: list[str] | None = setting(None, "skops: types to trust beyond inferd's list, as a JSON list "
                                              "of dotted names (an untrusted type refuses the load, naming it)",
                                              metavar="JSON")
    max_inflight_requests: int = setting(64, "requests the gateway sends one replica at once; their rows wait in "
                                         "the replica's own queue")

    def __post_init__(self):
        for name in ("max_batch_rows", "max_queue_rows", "max_queue_requests", "num_threads",
                     "max_inflight_requests"):
            if getattr(self, name) < 1:
                raise SettingError(name, "must be at least 1")
        if self.max_queue_delay_ms < 0:
            raise SettingError("max_queue_delay_ms", "must be at least 0")
        if self.features is not None:
            try:
                parsed = [Feature.parse(f) for f in self.features]
            except ValueError as exc:
                raise SettingError("features", str(exc)) from None
            if not parsed or len({f.name for f in parsed}) != len(parsed):
                raise SettingError("features", "at least one feature, and no name twice")
        if self.trusted_types is not None and not all(isinstance(t, str) for t in self.trusted_types):
            raise SettingError("trusted_types", "a list of dotted type names")
        if self.pickle_sha256 is not None and len(self.pickle_sha256) != 64:
            raise SettingError("pickle_sha256", "a sha256 is 64 hex digits")

    @property
    def schema_features(self) -> tuple[Feature, ...] | None:
        return None if self.features is None else tuple(Feature.parse(f) for f in self.features)

    @property
    def replica_slots(self) -> int:
        """Requests the gateway lets run on one replica at once."""
        return self.max_inflight_requests
