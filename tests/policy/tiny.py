"""A tiny policy for the serving logic's tests: the PolicyFiles interface, actions computed from the state
(so a test knows what each observation must get back), and an optional delay per forward pass."""
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HORIZON, DIM = 4, 2
SPEC = {"observation/image": {"shape": [8, 8, 3], "dtype": "uint8"},
        "observation/state": {"shape": [3], "dtype": "float32"},
        "prompt": {"shape": [], "dtype": "str"}}


@dataclass
class TinyPolicy:
    delay_s: float = 0.0
    name: str = "tiny-policy"
    path: Path = Path("tiny")
    digests: dict = field(default_factory=lambda: {"model": "0" * 64})
    action_horizon: int = HORIZON
    action_dim: int = DIM
    control_hz: float = 50.0
    observation_spec: dict = field(default_factory=lambda: dict(SPEC))
    batches: list[int] = field(default_factory=list)

    def metadata(self) -> dict:
        return {"name": self.name, "action_horizon": self.action_horizon, "action_dim": self.action_dim,
                "control_hz": self.control_hz, "observation_spec": self.observation_spec}

    def predict(self, observations: list[dict]) -> np.ndarray:
        self.batches.append(len(observations))
        if self.delay_s:
            time.sleep(self.delay_s)
        return np.stack([expected(o["observation/state"]) for o in observations])


def expected(state) -> np.ndarray:
    """The chunk the tiny policy answers a state with."""
    base = float(np.sum(state))
    return (base + np.arange(HORIZON * DIM, dtype=np.float32).reshape(HORIZON, DIM)).astype(np.float32)


def observation(state=(0.0, 1.0, 2.0), **extra) -> dict:
    return {"observation/image": np.zeros((8, 8, 3), np.uint8), "observation/state": np.asarray(state, np.float32),
            "prompt": "reach"} | extra
