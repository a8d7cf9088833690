"""The policy's file format and predict: what load_policy refuses, shapes, batching; the committed demo."""
import json
import shutil

import numpy as np
import pytest
import torch

from inferd.policy import sim
from inferd.policy.demo import DEMO_NAME, demo_policy_path
from inferd.policy.model import build_network, load_policy, save_policy
from inferd.policy.train import demo_config


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """A policy of the demo's architecture with random weights and non-trivial normalisation."""
    path = tmp_path_factory.mktemp("policy")
    torch.manual_seed(0)
    network = build_network(demo_config("random"))
    network.action_mean.copy_(torch.tensor([0.1, -0.2]))
    network.action_std.copy_(torch.tensor([0.5, 2.0]))
    save_policy(path, demo_config("random"), network)
    return path


def _observations(n: int) -> list[dict]:
    task = sim.ReacherTask(0)
    out = []
    for seed in range(n):
        task.reset(seed)
        for _ in range(seed % 5):
            task.step(task.expert_action())
        out.append(task.observation())
    return out


def test_predict_shapes_and_dtype(policy_dir):
    policy = load_policy(policy_dir)
    actions = policy.predict(_observations(3))
    assert actions.shape == (3, 10, 2) and actions.dtype == np.float32
    assert np.isfinite(actions).all()


def test_a_batch_predicts_what_one_by_one_does(policy_dir):
    policy = load_policy(policy_dir)
    observations = _observations(16)
    observations[3] = dict(observations[3], prompt="")  # no known word: an empty bag of tokens
    batched = policy.predict(observations)
    single = np.concatenate([policy.predict([o]) for o in observations])
    np.testing.assert_allclose(batched, single, atol=1e-5)


def test_the_traced_forward_is_the_network_at_any_batch_and_prompt_length(policy_dir):
    policy = load_policy(policy_dir)
    observations = _observations(5)
    observations[1] = dict(observations[1], prompt="")  # no token at all
    observations[2] = dict(observations[2], prompt="now reach the red target quickly and precisely please")
    for batch in ([observations[0]], observations[1:3], observations):
        inputs = policy.batch(batch)
        with torch.inference_mode():
            np.testing.assert_allclose(policy.forward(*inputs).numpy(), policy.network(*inputs).numpy(), atol=1e-5)


def test_the_prompt_and_the_image_reach_the_output(policy_dir):
    policy = load_policy(policy_dir)
    obs = _observations(1)[0]
    base = policy.predict([obs])
    assert not np.allclose(base, policy.predict([dict(obs, prompt="reach the blue target" if "red" in
                                                       obs["prompt"] else "reach the red target")]))
    assert not np.allclose(base, policy.predict([dict(obs, **{sim.IMAGE_KEY: np.zeros_like(obs[sim.IMAGE_KEY])})]))


def test_metadata_and_digests(policy_dir):
    policy = load_policy(policy_dir)
    meta = policy.metadata()
    assert meta["action_horizon"] == 10 and meta["action_dim"] == 2 and meta["control_hz"] == 50.0
    assert meta["name"] == "random"
    assert meta["observation_spec"][sim.IMAGE_KEY] == {"shape": [64, 64, 3], "dtype": "uint8"}
    assert meta["observation_spec"][sim.PROMPT_KEY]["dtype"] == "str"
    assert set(policy.digests) == {"config", "model"} and all(len(d) == 64 for d in policy.digests.values())
    assert load_policy(policy_dir, sha256=policy.digests["model"]).digests == policy.digests


def test_refuses_a_wrong_sha256(policy_dir):
    with pytest.raises(ValueError, match="model.safetensors"):
        load_policy(policy_dir, sha256="0" * 64)


def _broken(policy_dir, tmp_path, change) -> None:
    shutil.copytree(policy_dir, tmp_path / "p")
    config = json.loads((tmp_path / "p" / "config.json").read_text())
    change(config)
    (tmp_path / "p" / "config.json").write_text(json.dumps(config))


def test_refuses_a_config_missing_a_field(policy_dir, tmp_path):
    _broken(policy_dir, tmp_path, lambda c: c.pop("action_horizon"))
    with pytest.raises(ValueError, match="config.json.*action_horizon"):
        load_policy(tmp_path / "p")


def test_refuses_inputs_the_spec_does_not_declare(policy_dir, tmp_path):
    _broken(policy_dir, tmp_path, lambda c: c["observation_spec"].pop(sim.STATE_KEY))
    with pytest.raises(ValueError, match="config.json.*state"):
        load_policy(tmp_path / "p")


def test_refuses_tensors_that_do_not_match_the_architecture(policy_dir, tmp_path):
    _broken(policy_dir, tmp_path, lambda c: c["architecture"].update(hidden=128))
    with pytest.raises(ValueError, match="model.safetensors.*architecture"):
        load_policy(tmp_path / "p")
    _broken(policy_dir, tmp_path / "h", lambda c: c.update(action_horizon=5))
    with pytest.raises(ValueError, match="model.safetensors"):
        load_policy(tmp_path / "h" / "p")


def test_the_committed_demo_policy_loads_and_reaches():
    path = demo_policy_path()
    policy = load_policy(path)
    figures = json.loads((path / "training.json").read_text())
    assert policy.name == DEMO_NAME and (path / "model.safetensors").stat().st_size < 1_000_000
    result = sim.evaluate(lambda obs: policy.predict([obs])[0], episodes=10, seed=0)
    assert result["success_rate"] >= min(0.6, figures["policy_success_rate"] - 0.25)


def test_the_demo_policy_follows_the_instruction():
    """Told the other colour, it reaches the distractor instead of the goal."""
    policy = load_policy(demo_policy_path())
    swap = {"red": "blue", "blue": "red"}

    def told_the_other(obs):
        colour = obs[sim.PROMPT_KEY].split()[2]
        return policy.predict([dict(obs, prompt=f"reach the {swap[colour]} target")])[0]

    task = sim.ReacherTask(0)
    result = sim.evaluate(told_the_other, episodes=10, seed=0, task=task)
    assert result["success_rate"] <= 0.2
    assert np.linalg.norm(task.fingertip() - task.distractor) < 0.03  # the last episode's arm
