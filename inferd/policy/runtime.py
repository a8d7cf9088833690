"""The policy runtime: checked observations through the shared batcher (cost 1 each) into one batched
forward pass in the worker thread; each observation gets its own action chunk back, with the time it
waited and the time its batch ran."""
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inferd.policy.config import PolicyConfig
from inferd.protocol.headers import PriorityClass
from inferd.protocol.policy import ObservationSpec
from inferd.replica.batcher import Batcher, BatcherConfig, BatchReport


@dataclass(slots=True)
class Chunk:
    actions: np.ndarray  # [horizon, dim] float32
    queue_s: float  # arrival in the queue to its batch's start
    infer_s: float  # its batch's forward pass
    batch_size: int


class PolicyRuntime:
    """Owns the policy and its batcher; start() and stop() on the event loop that calls infer()."""

    def __init__(self, files, config: PolicyConfig, served_model_name: str | None = None,
                 on_batch: Callable[[BatchReport], None] | None = None):
        self.files, self.config = files, config
        self.name = served_model_name or files.name
        self.spec = ObservationSpec.from_dict(files.observation_spec)
        self.batcher: Batcher[tuple[dict, float], Chunk] = Batcher(self._run_batch, BatcherConfig(
            max_batch_cost=config.max_batch_size, max_batch_items=config.max_batch_size,
            max_queue_delay_ms=config.max_queue_delay_ms, max_queue_items=config.max_queue_observations,
            max_queue_cost=config.max_queue_observations), on_batch=on_batch)

    @classmethod
    def load(cls, source: str | Path | None = None, config: PolicyConfig | None = None,
             served_model_name: str | None = None, on_batch: Callable[[BatchReport], None] | None = None
             ) -> "PolicyRuntime":
        from inferd.policy.demo import demo_policy_path
        from inferd.policy.model import load_policy
        config = config or PolicyConfig()
        files = load_policy(source or demo_policy_path(), threads=config.num_threads)
        return cls(files, config, served_model_name, on_batch)

    def metadata(self) -> dict:
        """What a session hears first: the policy's own metadata, under the name it is served as."""
        return self.files.metadata() | {"name": self.name, "observation_spec": self.spec.as_dict()}

    def start(self) -> None:
        self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()

    async def infer(self, values: dict, priority: PriorityClass = "interactive",
                    deadline_s: float | None = None) -> Chunk:
        """values: an observation as protocol.policy.check_observation returns it."""
        [chunk] = await self.batcher.run([(values, time.monotonic())], [1], priority, deadline_s)
        return chunk

    def _run_batch(self, batch: list[tuple[dict, float]]) -> list[Chunk]:
        started = time.monotonic()
        actions = self.files.predict([values for values, _ in batch])
        infer_s = time.monotonic() - started
        return [Chunk(a, started - queued, infer_s, len(batch)) for a, (_, queued) in zip(actions, batch)]

    def readiness_observation(self) -> dict:
        """Zeros of every declared shape (an empty instruction for text)."""
        return {k.name: "" if k.dtype == "str" else np.zeros(k.shape, dtype=k.dtype) for k in self.spec.keys}
