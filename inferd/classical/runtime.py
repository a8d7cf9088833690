"""The classical runtime: checked rows through the shared batcher (cost = rows) into the model, answers out.

A request is one batcher item (a matrix of its rows), or several when it has more than max_batch_rows;
a batch concatenates its items' rows, runs the model once in the worker thread and hands each item its
slice back. Rows come back in input order.
"""
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from inferd.classical.config import ClassicalConfig
from inferd.classical.formats import ClassicalModelFiles, load_classical_model
from inferd.protocol.headers import PriorityClass
from inferd.replica.batcher import Batcher, BatcherConfig, BatchReport

Answer = tuple[np.ndarray, np.ndarray | None]  # predictions, a classifier's probabilities


@dataclass(slots=True)
class ClassicalInfo:
    name: str
    format: str  # onnx | xgboost | lightgbm | skops | pickle
    platform: str  # the Open Inference Protocol's: onnxruntime_onnx, xgboost, lightgbm, sklearn
    library: str  # what runs it, with its version
    version: str  # the model file's sha256, first 12 hex digits
    source_path: str
    digests: dict[str, str] = field(default_factory=dict)


class ClassicalRuntime:
    """Owns the model and its batcher; start() and stop() on the event loop that calls predict()."""

    def __init__(self, files: ClassicalModelFiles, config: ClassicalConfig, served_model_name: str | None = None,
                 on_batch: Callable[[BatchReport], None] | None = None):
        self.files, self.config, self.schema = files, config, files.schema
        self.info = ClassicalInfo(served_model_name or files.name, files.format, files.platform,
                                  files.predictor.library, files.digests["model"][:12], str(files.path),
                                  dict(files.digests))
        self.batcher: Batcher[np.ndarray, Answer] = Batcher(self.predict_batch, BatcherConfig(
            max_batch_cost=config.max_batch_rows, max_batch_items=config.max_batch_rows,
            max_queue_delay_ms=config.max_queue_delay_ms, max_queue_items=config.max_queue_requests,
            max_queue_cost=config.max_queue_rows), on_batch=on_batch)

    @classmethod
    def load(cls, source: str | Path | None = None, config: ClassicalConfig | None = None,
             served_model_name: str | None = None, on_batch: Callable[[BatchReport], None] | None = None
             ) -> "ClassicalRuntime":
        config = config or ClassicalConfig()
        return cls(load_classical_model(source, config), config, served_model_name, on_batch)

    @property
    def task(self) -> str:
        return self.schema.task

    def start(self) -> None:
        self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()

    async def predict(self, rows: np.ndarray, priority: PriorityClass = "interactive",
                      deadline_s: float | None = None) -> Answer:
        """rows: [n, features] float64 as protocol.classical.feature_matrix makes it."""
        step = self.config.max_batch_rows
        pieces = [rows[i:i + step] for i in range(0, len(rows), step)]
        answers = await self.batcher.run(pieces, [len(p) for p in pieces], priority, deadline_s)
        if len(answers) == 1:
            return answers[0]
        probabilities = None if answers[0][1] is None else np.concatenate([a[1] for a in answers])
        return np.concatenate([a[0] for a in answers]), probabilities

    def predict_batch(self, batch: list[np.ndarray]) -> list[Answer]:
        """One model call over the batch's rows (the worker thread calls it)."""
        rows = batch[0] if len(batch) == 1 else np.concatenate(batch)
        predictions, probabilities = self.files.predictor.predict(rows)
        assert len(predictions) == len(rows), f"{len(predictions)} predictions for {len(rows)} rows"
        out, at = [], 0
        for piece in batch:
            end = at + len(piece)
            out.append((predictions[at:end], None if probabilities is None else probabilities[at:end]))
            at = end
        return out

    def readiness_rows(self) -> np.ndarray:
        """One row of zeros: every dtype takes 0."""
        return np.zeros((1, len(self.schema.features)), dtype=np.float64)
