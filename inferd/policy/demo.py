"""The demo policy: an action-chunking policy for sim.py's reacher task (reach the red or the blue target, as
the prompt says), behaviour-cloned from the scripted expert by train.py. Its directory is committed with the
package (demo_policy/: config.json, model.safetensors, training.json with the success rates it was measured
at); a checkout without it trains it there again (a few minutes on one core)."""
import logging
from pathlib import Path

log = logging.getLogger(__name__)

DEMO_NAME = "reacher-bc"
DEMO_DIR = Path(__file__).resolve().parent / "demo_policy"


def demo_policy_path() -> Path:
    """The demo policy's directory, trained and written first if it is not there."""
    if not (DEMO_DIR / "config.json").is_file() or not (DEMO_DIR / "model.safetensors").is_file():
        from inferd.policy.train import train_demo
        log.info("training the demo policy %s into %s (a few minutes)", DEMO_NAME, DEMO_DIR)
        figures = train_demo(DEMO_DIR, name=DEMO_NAME, progress=True)
        log.info("trained %s: success %.2f (the expert's %.2f)", DEMO_NAME, figures["policy_success_rate"],
                 figures["expert_success_rate"])
    return DEMO_DIR
