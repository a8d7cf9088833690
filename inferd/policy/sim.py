"""The demo policy's task: Gymnasium's MuJoCo `Reacher-v5` (a two-link planar arm, two torques in [-1, 1],
dt = 0.02 s, so control at 50 Hz) with two targets, a red and a blue one, and an instruction that says which
to reach ("reach the red target" or "reach the blue target"). The goal is the simulator's own target body;
the other colour is a distractor that only the camera draws (Reacher's target touches nothing, so neither
changes the physics).

The camera is this module's own: a top-down orthographic raster of the scene drawn with numpy from the
simulator's body positions (the two links as thick lines, the fingertip and both targets as discs, all
anti-aliased, each shape only within its bounding box) into a 64x64x3 uint8 image, about 0.2 ms a frame.
MuJoCo's GL renderer costs ~13 ms a frame on a machine without a GPU (llvmpipe), too slow for many
simulated robots at 50 Hz.

What the policy sees (openpi's keys): "observation/image" (the raster), "observation/state" (float32 [6]: cos
and sin of both joint angles, both joint velocities; the arm only, so the targets are only in the image)
and "prompt" (the instruction, so the colour is only in the prompt).

Success: the fingertip within SUCCESS_RADIUS (0.02) of the goal after the episode's EPISODE_STEPS (50) steps.
`evaluate` runs episodes in closed loop, executing action chunks the way openpi-client's ActionChunkBroker
does."""
from typing import Callable

import numpy as np

EPISODE_STEPS = 50
SUCCESS_RADIUS = 0.02
CONTROL_HZ = 50.0  # Reacher-v5: timestep 0.01 s, frame_skip 2
IMAGE_SIZE = 64
IMAGE_KEY, STATE_KEY, PROMPT_KEY = "observation/image", "observation/state", "prompt"
COLOURS = {"red": (220, 40, 40), "blue": (40, 70, 230)}

_LINK1, _LINK2 = 0.1, 0.11  # shoulder to elbow, elbow to fingertip (reacher.xml)
_GOAL_RADIUS = 0.2  # Reacher-v5 draws its target uniformly in this disc
_MIN_SEPARATION = 0.06  # between goal and distractor, so the two discs never merge in the image
_VIEW = 0.25  # the image spans [-0.25, 0.25] m in x and y; the arm reaches 0.21
_BACKGROUND, _ARM, _FINGERTIP = (225, 225, 225), (70, 70, 70), (20, 20, 20)
_KP, _KD = 1.0, 0.1  # the expert's PD gains on the joint-angle error (rad) and joint velocity (rad/s)

_pixels = ((np.arange(IMAGE_SIZE) + 0.5) / IMAGE_SIZE * 2 * _VIEW - _VIEW).astype(np.float32)
_PX = np.ascontiguousarray(np.broadcast_to(_pixels[None, :], (IMAGE_SIZE, IMAGE_SIZE)))  # x grows to the right (columns)
_PY = np.ascontiguousarray(np.broadcast_to(_pixels[::-1, None], (IMAGE_SIZE, IMAGE_SIZE)))  # y grows upwards (row 0 is the top)
_METRES_PER_PIXEL = 2 * _VIEW / IMAGE_SIZE


def pixel_of(xy: np.ndarray) -> tuple[int, int]:
    """The (row, column) of the pixel a point of the plane falls in."""
    col = int((xy[0] + _VIEW) / _METRES_PER_PIXEL)
    row = int((_VIEW - xy[1]) / _METRES_PER_PIXEL)
    return row, col


class ReacherTask:
    """One simulated robot: Reacher-v5's MuJoCo model and data (stepped directly, without gymnasium's
    wrappers), the instruction's colour and the distractor. Not thread-safe: one owner steps it."""

    def __init__(self, seed: int = 0):
        from gymnasium.envs.mujoco.reacher_v5 import ReacherEnv
        self.env = ReacherEnv()  # no render_mode: no GL context is ever made
        self.steps = 0
        self.reset(seed)

    def reset(self, seed: int) -> dict:
        self.env.reset(seed=seed)  # arm and goal, drawn as Reacher-v5 draws them
        rng = np.random.default_rng([seed, 1])  # the colour and the distractor, from the same seed
        self.colour = ("red", "blue")[int(rng.integers(2))]
        while True:
            d = rng.uniform(-_GOAL_RADIUS, _GOAL_RADIUS, size=2)
            if np.linalg.norm(d) < _GOAL_RADIUS and np.linalg.norm(d - self.goal()) > _MIN_SEPARATION:
                break
        self.distractor = d
        self.steps = 0
        return self.observation()

    @property
    def prompt(self) -> str:
        return f"reach the {self.colour} target"

    def goal(self) -> np.ndarray:
        return self.env.data.qpos[2:4].copy()

    def fingertip(self) -> np.ndarray:
        return self.env.data.xpos[3, :2].copy()

    def step(self, action: np.ndarray) -> dict:
        """One control step (0.02 s); the simulator clips the torques to [-1, 1]."""
        self.env.do_simulation(np.asarray(action, dtype=np.float64), self.env.frame_skip)
        self.steps += 1
        return self.observation()

    def observation(self) -> dict:
        q, qd = self.env.data.qpos[:2], self.env.data.qvel[:2]
        state = np.concatenate([np.cos(q), np.sin(q), qd]).astype(np.float32)
        return {IMAGE_KEY: self.image(), STATE_KEY: state, PROMPT_KEY: self.prompt}

    def image(self) -> np.ndarray:
        """The top-down raster: links, fingertip, then both targets on top (so a target stays visible)."""
        xpos = self.env.data.xpos
        shoulder, elbow, tip = xpos[1, :2], xpos[2, :2], xpos[3, :2]
        other = "blue" if self.colour == "red" else "red"
        img = np.empty((IMAGE_SIZE, IMAGE_SIZE, 3), np.float32)
        img[:] = _BACKGROUND
        for a, b in ((shoulder, elbow), (elbow, tip)):
            _paint_segment(img, a, b, 0.012, _ARM)
        _paint_disc(img, tip, 0.012, _FINGERTIP)
        _paint_disc(img, self.goal(), 0.014, COLOURS[self.colour])
        _paint_disc(img, self.distractor, 0.014, COLOURS[other])
        return img.astype(np.uint8)

    def success(self) -> bool:
        return bool(np.linalg.norm(self.fingertip() - self.goal()) < SUCCESS_RADIUS)

    def expert_action(self) -> np.ndarray:
        """Analytic inverse kinematics toward the goal (always the elbow-positive solution, so the expert is
        a function of the state and goal alone), then PD torques clipped to [-1, 1]."""
        x, y = self.goal()
        c2 = np.clip((x * x + y * y - _LINK1 ** 2 - _LINK2 ** 2) / (2 * _LINK1 * _LINK2), -1.0, 1.0)
        q2 = np.arccos(c2)
        q1 = np.arctan2(y, x) - np.arctan2(_LINK2 * np.sin(q2), _LINK1 + _LINK2 * np.cos(q2))
        q, qd = self.env.data.qpos[:2], self.env.data.qvel[:2]
        error = np.array([_wrap(q1 - q[0]), q2 - q[1]])
        return np.clip(_KP * error - _KD * qd, -1.0, 1.0).astype(np.float32)

    def expert_chunk(self, horizon: int) -> np.ndarray:
        """The expert's next `horizon` actions from the current state, simulated ahead and undone: what the
        expert would execute open loop. [horizon, 2] float32."""
        data = self.env.data
        saved = data.qpos.copy(), data.qvel.copy(), data.time
        chunk = np.empty((horizon, 2), np.float32)
        for i in range(horizon):
            chunk[i] = self.expert_action()
            self.env.do_simulation(chunk[i].astype(np.float64), self.env.frame_skip)
        self.env.set_state(saved[0], saved[1])
        data.time = saved[2]
        return chunk


def evaluate(chunk_fn: Callable[[dict], np.ndarray], episodes: int = 100, seed: int = 0,
             task: ReacherTask | None = None) -> dict:
    """Closed-loop episodes with seeds seed, seed + 1, ...: ask chunk_fn(observation) for a chunk
    [horizon, 2], execute its actions one a step, ask again when they run out (openpi-client's
    ActionChunkBroker), for EPISODE_STEPS steps; then check success. task: the one to run the episodes in
    (the expert's chunk_fn reads it: `evaluate(lambda obs: task.expert_chunk(10), task=task)`); a new one
    by default. Returns episodes, successes, success_rate and mean_final_distance (m)."""
    task = task or ReacherTask(seed)
    successes, distances = 0, []
    for episode in range(episodes):
        obs = task.reset(seed + episode)
        chunk, used = None, 0
        for _ in range(EPISODE_STEPS):
            if chunk is None or used == len(chunk):
                chunk, used = np.asarray(chunk_fn(obs)), 0
            obs = task.step(chunk[used])
            used += 1
        successes += task.success()
        distances.append(float(np.linalg.norm(task.fingertip() - task.goal())))
    return {"episodes": episodes, "successes": successes, "success_rate": successes / episodes,
            "mean_final_distance": float(np.mean(distances))}


def _wrap(angle: float) -> float:
    return float((angle + np.pi) % (2 * np.pi) - np.pi)


def _paint_disc(img: np.ndarray, centre: np.ndarray, radius: float, colour: tuple) -> None:
    rows, cols = _window(centre, centre, radius)
    _blend(img, rows, cols, np.hypot(_PX[rows, cols] - centre[0], _PY[rows, cols] - centre[1]), radius, colour)


def _paint_segment(img: np.ndarray, a: np.ndarray, b: np.ndarray, radius: float, colour: tuple) -> None:
    rows, cols = _window(a, b, radius)
    px, py = _PX[rows, cols] - a[0], _PY[rows, cols] - a[1]
    ab = b - a
    t = np.clip((px * ab[0] + py * ab[1]) / max(float(ab @ ab), 1e-12), 0.0, 1.0)
    _blend(img, rows, cols, np.hypot(px - t * ab[0], py - t * ab[1]), radius, colour)


def _window(a: np.ndarray, b: np.ndarray, radius: float) -> tuple[slice, slice]:
    """The pixels a shape between points a and b, thickened by radius, can touch (and a pixel's margin for
    the anti-aliased edge): only those are drawn."""
    lo, hi = np.minimum(a, b) - radius, np.maximum(a, b) + radius
    c0, c1 = np.floor((np.array([lo[0], hi[0]]) + _VIEW) / _METRES_PER_PIXEL).astype(int) + (-1, 2)
    r0, r1 = np.floor((_VIEW - np.array([hi[1], lo[1]])) / _METRES_PER_PIXEL).astype(int) + (-1, 2)
    return slice(max(r0, 0), max(min(r1, IMAGE_SIZE), 0)), slice(max(c0, 0), max(min(c1, IMAGE_SIZE), 0))


def _blend(img: np.ndarray, rows: slice, cols: slice, distance: np.ndarray, radius: float, colour: tuple) -> None:
    """Blend colour over the pixels within radius (metres), with a one-pixel anti-aliased edge."""
    cover = np.clip((radius - distance) / _METRES_PER_PIXEL + 0.5, 0.0, 1.0)[..., None]
    img[rows, cols] += cover * (np.asarray(colour, np.float32) - img[rows, cols])
