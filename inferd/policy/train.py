"""Train the demo policy by behaviour cloning the scripted expert of sim.py, then measure it in the simulator.

1. Collect: `episodes` expert episodes (seeds from TRAIN_SEED on, apart from the evaluation's seeds). At each
   visited state the label is the expert's next action_horizon actions from that state, simulated ahead and
   undone (what the expert would execute open loop, so no padding at the episode's end is needed). The
   actions executed are the expert's plus Gaussian noise (DART), so the data holds states off the expert's
   path and the expert's way back from them.
2. Clone: MSE on normalised action chunks, plus a training-only probe's MSE on the goal's position read off
   the image keypoints; Adam (a short warm-up, then a cosine decay), on one CPU thread.
3. Evaluate: sim.evaluate over EVAL_EPISODES held-out episodes, the policy and the expert alike, executing
   whole chunks (openpi-client's ActionChunkBroker).

The figures go to training.json beside config.json and model.safetensors; `python -m inferd.policy.train
--out DIR` runs it all."""
import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from inferd.policy import sim
from inferd.policy.model import MODEL_FILE, build_network, load_policy, prompt_tokens, save_policy

TRAIN_SEED = 1_000_000
EVAL_EPISODES, EVAL_SEED = 100, 0
HORIZON = 10
ARCHITECTURE = {"inputs": {"image": sim.IMAGE_KEY, "state": sim.STATE_KEY, "prompt": sim.PROMPT_KEY},
                "conv_channels": [16, 32, 32], "keypoints": 16, "keypoint_scale": 10.0, "state_hidden": 64, "vocab_size": 256,
                "text_dim": 16, "hidden": 256, "layers": 2}


def demo_config(name: str) -> dict:
    return {"name": name, "architecture": ARCHITECTURE, "action_horizon": HORIZON, "action_dim": 2,
            "control_hz": sim.CONTROL_HZ,
            "observation_spec": {sim.IMAGE_KEY: {"shape": [sim.IMAGE_SIZE, sim.IMAGE_SIZE, 3], "dtype": "uint8"},
                                 sim.STATE_KEY: {"shape": [6], "dtype": "float32"},
                                 sim.PROMPT_KEY: {"shape": [], "dtype": "str"}}}


def collect(episodes: int, horizon: int, noise: float, seed: int, progress: bool) -> dict:
    """Observations and the expert's chunks from `episodes` noisy expert episodes."""
    from tqdm import tqdm
    rng = np.random.default_rng(seed)
    task = sim.ReacherTask(seed)
    steps = episodes * sim.EPISODE_STEPS
    data = {"images": np.empty((steps, sim.IMAGE_SIZE, sim.IMAGE_SIZE, 3), np.uint8),
            "states": np.empty((steps, 6), np.float32), "goals": np.empty((steps, 2), np.float32), "prompts": [], "chunks": np.empty((steps, horizon, 2), np.float32)}
    i = 0
    for episode in tqdm(range(episodes), desc="expert demonstrations", disable=not progress):
        obs = task.reset(seed + episode)
        for _ in range(sim.EPISODE_STEPS):
            data["images"][i], data["states"][i] = obs[sim.IMAGE_KEY], obs[sim.STATE_KEY]
            data["prompts"].append(obs[sim.PROMPT_KEY])
            data["goals"][i] = task.goal()
            data["chunks"][i] = task.expert_chunk(horizon)
            obs = task.step(np.clip(data["chunks"][i, 0] + rng.normal(0.0, noise, 2), -1.0, 1.0))
            i += 1
    return data


def train_demo(out_dir: str | Path, episodes: int = 300, epochs: int = 20, seed: int = 0, progress: bool = True,
               noise: float = 0.3, name: str = "reacher-bc", threads: int = 1) -> dict:
    """Collect, clone, evaluate, and write the policy directory out_dir (config.json, model.safetensors,
    training.json). Returns training.json's figures."""
    from tqdm import tqdm
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    started = time.perf_counter()
    data = collect(episodes, HORIZON, noise, TRAIN_SEED + seed * episodes, progress)
    collected = time.perf_counter()

    config = demo_config(name)
    network = build_network(config)
    states, chunks = torch.from_numpy(data["states"]), torch.from_numpy(data["chunks"])
    network.state_mean.copy_(states.mean(0))
    network.state_std.copy_(states.std(0).clamp_min(1e-3))
    network.action_mean.copy_(chunks.reshape(-1, 2).mean(0))
    network.action_std.copy_(chunks.reshape(-1, 2).std(0).clamp_min(1e-3))
    targets = (chunks - network.action_mean) / network.action_std
    images = torch.from_numpy(data["images"])
    goals = torch.from_numpy(data["goals"]) / 0.2  # the goal lies within 0.2 m of the shoulder
    # Training only: a probe that reads the goal off the keypoints. Without its loss, cloning left the
    # goal's position unused (the loss stalled where the arm alone explains it); the probe is not saved.
    probe = torch.nn.Sequential(torch.nn.Linear(2 * ARCHITECTURE["keypoints"], 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 2))
    prompt_ids = [prompt_tokens(p, ARCHITECTURE["vocab_size"]) for p in data["prompts"]]

    batch_size, n = 128, len(targets)
    batches = epochs * ((n + batch_size - 1) // batch_size)
    optimiser = torch.optim.Adam([*network.parameters(), *probe.parameters()], lr=2e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=2e-3, total_steps=batches, pct_start=0.05)
    generator = torch.Generator().manual_seed(seed)
    network.train()
    bar = tqdm(total=batches, desc="behaviour cloning", disable=not progress)
    for epoch in range(epochs):
        order, total, total_goal = torch.randperm(n, generator=generator), 0.0, 0.0
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            token_lists = [prompt_ids[j] for j in idx.tolist()]
            offsets = torch.tensor(np.cumsum([0] + [len(t) for t in token_lists[:-1]]), dtype=torch.long)
            tokens = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long)
            keypoints, state, text = network.encode(images[idx], states[idx], tokens, offsets)
            loss = torch.nn.functional.mse_loss(network.act(keypoints, state, text), targets[idx])
            goal_loss = torch.nn.functional.mse_loss(probe(keypoints), goals[idx])
            total_goal += goal_loss.item() * len(idx)
            loss = loss + goal_loss
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            schedule.step()
            total += (loss.item() - goal_loss.item()) * len(idx)
            bar.update()
        bar.set_postfix(epoch=epoch + 1, loss=f"{total / n:.4f}", goal_loss=f"{total_goal / n:.4f}")
    bar.close()
    trained = time.perf_counter()

    out_dir = Path(out_dir)
    save_policy(out_dir, config, network.eval())
    policy = load_policy(out_dir)
    result = sim.evaluate(lambda obs: policy.predict([obs])[0], EVAL_EPISODES, EVAL_SEED)
    task = sim.ReacherTask(EVAL_SEED)
    expert = sim.evaluate(lambda obs: task.expert_chunk(HORIZON), EVAL_EPISODES, EVAL_SEED, task=task)
    figures = {
        "policy": name, "task": "Reacher-v5 with a red and a blue target, the prompt names the goal's colour",
        "success": f"fingertip within {sim.SUCCESS_RADIUS} m of the goal after {sim.EPISODE_STEPS} steps",
        "eval_episodes": EVAL_EPISODES, "eval_seeds": f"{EVAL_SEED}..{EVAL_SEED + EVAL_EPISODES - 1}",
        "policy_success_rate": result["success_rate"], "policy_mean_final_distance": result["mean_final_distance"],
        "expert_success_rate": expert["success_rate"], "expert_mean_final_distance": expert["mean_final_distance"],
        "chunk_execution": f"{HORIZON} actions a chunk, executed open loop (ActionChunkBroker)",
        "demos": episodes, "samples": n, "dart_noise_std": noise, "epochs": epochs, "batch_size": batch_size,
        "final_loss": total / n, "final_goal_probe_loss": total_goal / n, "seed": seed, "threads": threads,
        "collect_wall_s": round(collected - started, 1), "train_wall_s": round(trained - collected, 1),
        "total_wall_s": round(time.perf_counter() - started, 1),
        "model_bytes": (out_dir / MODEL_FILE).stat().st_size,
        "parameters": sum(p.numel() for p in network.parameters()),
        "machine": _machine(), "torch": torch.__version__}
    (out_dir / "training.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def _machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration, subprocess.SubprocessError):
        model = platform.processor() or platform.machine()
    return f"{model}, {platform.system()} {platform.machine()}"


def main() -> None:
    parser = argparse.ArgumentParser(description="Train the demo policy on the simulated reacher task.")
    parser.add_argument("--out", required=True, help="the policy directory to write")
    parser.add_argument("--episodes", type=int, default=300, help="expert demonstrations")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--noise", type=float, default=0.3, help="DART noise on the executed actions (std)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    figures = train_demo(args.out, args.episodes, args.epochs, args.seed, noise=args.noise)
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
