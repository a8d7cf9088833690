"""The reacher task: its camera draws what the simulator holds, the expert reaches, evaluate runs chunks."""
import time

import numpy as np

from inferd.policy import sim


def _colour_mask(image: np.ndarray, colour: str) -> np.ndarray:
    """How much each pixel is of the colour: its channel above the other two."""
    img = image.astype(int)
    channel = {"red": 0, "blue": 2}[colour]
    return img[..., channel] - np.delete(img, channel, axis=2).max(axis=2)


def _brightest(image: np.ndarray, colour: str) -> tuple[int, int]:
    mask = _colour_mask(image, colour)
    return np.unravel_index(np.argmax(mask), mask.shape)


def test_observation_keys_shapes_and_dtypes():
    obs = sim.ReacherTask(0).observation()
    assert set(obs) == {sim.IMAGE_KEY, sim.STATE_KEY, sim.PROMPT_KEY}
    assert obs[sim.IMAGE_KEY].shape == (64, 64, 3) and obs[sim.IMAGE_KEY].dtype == np.uint8
    assert obs[sim.STATE_KEY].shape == (6,) and obs[sim.STATE_KEY].dtype == np.float32
    assert obs[sim.PROMPT_KEY] in ("reach the red target", "reach the blue target")


def test_the_state_holds_the_arm_only():
    task = sim.ReacherTask(3)
    q, qd = task.env.data.qpos[:2], task.env.data.qvel[:2]
    expected = np.concatenate([np.cos(q), np.sin(q), qd]).astype(np.float32)
    np.testing.assert_array_equal(task.observation()[sim.STATE_KEY], expected)


def test_the_camera_draws_each_target_where_the_simulator_puts_it():
    task = sim.ReacherTask(0)
    colours = set()
    for seed in range(12):
        task.reset(seed)
        colours.add(task.colour)
        other = "blue" if task.colour == "red" else "red"
        image = task.image()
        for colour, where in ((task.colour, task.goal()), (other, task.distractor)):
            row, col = _brightest(image, colour)
            want = sim.pixel_of(where)
            assert abs(row - want[0]) <= 1 and abs(col - want[1]) <= 1, (seed, colour, (row, col), want)
    assert colours == {"red", "blue"}  # the instruction varies with the seed


def test_the_goal_moves_in_the_image_when_it_moves_in_the_simulator():
    task = sim.ReacherTask(1)
    data = task.env.data
    before = _brightest(task.image(), task.colour)
    qpos = data.qpos.copy()
    qpos[2:4] = [-0.15, 0.1]
    task.env.set_state(qpos, data.qvel.copy())
    after = _brightest(task.image(), task.colour)
    assert after != before
    assert abs(after[0] - sim.pixel_of(np.array([-0.15, 0.1]))[0]) <= 1
    assert abs(after[1] - sim.pixel_of(np.array([-0.15, 0.1]))[1]) <= 1


def test_the_arm_is_drawn_and_moves_with_the_joints():
    task = sim.ReacherTask(2)
    image = task.image().astype(int)
    dark = image.sum(axis=2) < 300
    row, col = sim.pixel_of(task.fingertip())
    assert dark[row, col]  # the fingertip is drawn where it is
    for _ in range(10):
        task.step(task.expert_action())
    assert not np.array_equal(task.image(), image.astype(np.uint8))


def test_a_frame_takes_well_under_a_millisecond():
    task = sim.ReacherTask(0)
    task.image()
    start = time.perf_counter()
    for _ in range(200):
        task.image()
    assert (time.perf_counter() - start) / 200 < 1e-3


def test_the_expert_succeeds_and_a_still_arm_does_not():
    task = sim.ReacherTask(0)
    expert = sim.evaluate(lambda obs: task.expert_chunk(10), episodes=10, seed=100, task=task)
    assert expert["successes"] == 10 and expert["mean_final_distance"] < sim.SUCCESS_RADIUS / 4
    still = sim.evaluate(lambda obs: np.zeros((10, 2), np.float32), episodes=10, seed=100)
    assert still["success_rate"] <= 0.2


def test_evaluate_asks_for_a_chunk_when_the_last_one_runs_out():
    calls = []

    def chunk_fn(obs):
        calls.append(obs)
        return np.zeros((7, 2), np.float32)

    sim.evaluate(chunk_fn, episodes=2, seed=0)
    assert len(calls) == 2 * -(-sim.EPISODE_STEPS // 7)


def test_expert_chunk_leaves_the_simulator_as_it_was():
    task = sim.ReacherTask(5)
    before = task.observation()
    chunk = task.expert_chunk(10)
    after = task.observation()
    assert chunk.shape == (10, 2) and chunk.dtype == np.float32
    np.testing.assert_array_equal(before[sim.STATE_KEY], after[sim.STATE_KEY])
    np.testing.assert_array_equal(before[sim.IMAGE_KEY], after[sim.IMAGE_KEY])
    np.testing.assert_allclose(chunk[0], task.expert_action())
