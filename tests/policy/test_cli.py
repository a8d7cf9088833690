"""`inferd policy train-demo`: the command line writes a policy directory that loads and says how it did."""
import json

from inferd.policy.model import load_policy
from tests.server import inferd


def test_train_demo_writes_a_loadable_policy_with_its_figures(tmp_path):
    out = tmp_path / "tiny-bc"
    printed = json.loads(inferd("policy", "train-demo", "--out", str(out), "--episodes", "3", "--epochs", "1"))
    files = load_policy(out, sha256=printed.get("model_sha256"))
    assert files.action_horizon == 10 and files.observation_spec["observation/image"]["shape"] == [64, 64, 3]
    written = json.loads((out / "training.json").read_text())
    assert written["demos"] == 3 and written["epochs"] == 1 and 0 <= written["policy_success_rate"] <= 1
    assert written["expert_success_rate"] >= 0.95  # the expert does not depend on the training
