"""A policy replica's settings, written once: the fields (with their help) make its flags and spec keys."""
from dataclasses import dataclass

from inferd.settings import SettingError, setting


@dataclass(slots=True)
class PolicyConfig:
    max_batch_size: int = setting(16, "observations (from any sessions) per forward pass")
    max_queue_delay_ms: float = setting(2.0, "after a busy batch, how long the next may wait to fill, from its "
                                        "oldest observation's arrival; an idle policy starts at once")
    max_queue_observations: int = setting(256, "observations waiting at most; beyond: refused as overloaded")
    num_threads: int = setting(1, "threads one forward pass runs on (torch intra-op)")
    max_frame_bytes: int = setting(8 * 2**20, "the largest observation frame a session may send; a larger one "
                                   "is answered frame_too_large")
    max_sessions: int = setting(64, "robot sessions one replica serves at once; the deployment's cap is this "
                                "times its replicas")
    idle_timeout_s: float = setting(300.0, "a session that sends no observation for this long is closed (4408)")

    def __post_init__(self):
        for name in ("max_batch_size", "max_queue_observations", "num_threads", "max_frame_bytes", "max_sessions"):
            if getattr(self, name) < 1:
                raise SettingError(name, "must be at least 1")
        if self.max_queue_delay_ms < 0:
            raise SettingError("max_queue_delay_ms", "must be at least 0")
        if self.idle_timeout_s <= 0:
            raise SettingError("idle_timeout_s", "must be positive")

    @property
    def replica_slots(self) -> int:
        """Observations the gateway lets run on one replica at once (one per session at most)."""
        return self.max_sessions
