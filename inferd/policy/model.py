"""Our action-chunking robot policy and its file format.

The network (`ChunkPolicy`): the instruction as a bag of hashed word tokens (crc32 of each lower-cased word
modulo the vocabulary, averaged by an EmbeddingBag: no tokenizer to download); the camera image through a
small CNN whose first layer's features the instruction scales and shifts (FiLM: that is how "red" or "blue"
picks a target; with the instruction only beside the image features, cloning did not learn to choose) and
whose last feature maps become keypoints by a spatial softmax (each map's expected x and y); the state
through an MLP; all concatenated, and an MLP head that outputs action_horizon x action_dim actions.
The network works in normalised units: states and actions are standardised by the training set's mean and
standard deviation, kept as buffers beside the weights.

A policy is a directory:
- config.json: name, architecture (layer sizes, which observation key is the image, the state and the
  prompt), action_horizon, action_dim, control_hz, observation_spec = {key: {"shape": [...], "dtype":
  "uint8" | "float32" | "str"}} for every key the policy reads;
- model.safetensors: the weights and the normalisation buffers.

`load_policy` checks both and returns a `PolicyFiles`, whose `predict` runs one batched forward in fp32
under torch.inference_mode, of the network traced to TorchScript at load (`trace`): its ops then run one after
the other in C++ with the GIL released, so a forward neither waits on another thread's Python between its
ops (a policy served in the gateway's process shares the GIL with its event loop) nor holds it
(`python -m inferd.policy.model DIR` times it; benchmarks/README.md has the figures)."""
import hashlib
import json
import logging
import re
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

log = logging.getLogger(__name__)

CONFIG_FILE, MODEL_FILE = "config.json", "model.safetensors"
REQUIRED = ("architecture", "action_horizon", "action_dim", "control_hz", "observation_spec")
ARCHITECTURE = ("inputs", "conv_channels", "keypoints", "keypoint_scale", "state_hidden", "vocab_size", "text_dim",
                "hidden", "layers")
DTYPES = {"uint8": np.uint8, "float32": np.float32, "str": str}


def prompt_tokens(prompt: str, vocab_size: int) -> list[int]:
    """The instruction's words (lower-cased runs of letters and digits), each hashed into the vocabulary."""
    return [zlib.crc32(w.encode()) % vocab_size for w in re.findall(r"[a-z0-9]+", prompt.lower())]


class ChunkPolicy(nn.Module):
    """Image, state and instruction in; [B, horizon, dim] normalised actions out."""

    def __init__(self, architecture: dict, image_shape: list[int], state_dim: int, horizon: int, dim: int):
        super().__init__()
        a = architecture
        self.horizon, self.dim, self.vocab_size = horizon, dim, a["vocab_size"]
        self.keypoint_scale = float(a["keypoint_scale"])
        height, width, colours = image_shape
        c = a["conv_channels"]
        self.conv1 = nn.Conv2d(colours, c[0], 5, stride=2, padding=2)
        self.film = nn.Linear(a["text_dim"], 2 * c[0])  # the instruction scales and shifts conv1's features
        self.cnn = nn.Sequential(
            nn.Conv2d(c[0], c[1], 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(c[1], c[2], 3, padding=1), nn.ReLU(),
            nn.Conv2d(c[2], a["keypoints"], 1))
        h, w = -(-height // 4), -(-width // 4)  # the maps after two stride-2 convolutions
        self.register_buffer("grid_x", torch.linspace(-1, 1, w).repeat(h), persistent=False)
        self.register_buffer("grid_y", torch.linspace(-1, 1, h).repeat_interleave(w), persistent=False)
        self.state_mlp = nn.Sequential(nn.Linear(state_dim, a["state_hidden"]), nn.ReLU())
        self.text = nn.EmbeddingBag(a["vocab_size"], a["text_dim"], mode="mean")
        layers, width_in = [], 2 * a["keypoints"] + a["state_hidden"] + a["text_dim"]
        for _ in range(a["layers"]):
            layers += [nn.Linear(width_in, a["hidden"]), nn.ReLU()]
            width_in = a["hidden"]
        self.head = nn.Sequential(*layers, nn.Linear(width_in, horizon * dim))
        for name, size in (("state_mean", state_dim), ("state_std", state_dim), ("action_mean", dim),
                           ("action_std", dim)):
            self.register_buffer(name, torch.zeros(size) if name.endswith("mean") else torch.ones(size))

    def forward(self, images: torch.Tensor, states: torch.Tensor, tokens: torch.Tensor,
                offsets: torch.Tensor) -> torch.Tensor:
        """images uint8 [B, H, W, C]; states float32 [B, S] in state units; tokens and offsets as
        nn.EmbeddingBag takes them. Returns normalised actions [B, horizon, dim]."""
        return self.act(*self.encode(images, states, tokens, offsets))

    def encode(self, images, states, tokens, offsets) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The keypoints [B, 2K] (in [-1, 1]), the state's features and the instruction's embedding."""
        text = self.text(tokens, offsets)
        scale, shift = self.film(text)[:, :, None, None].chunk(2, dim=1)
        x = self.conv1(images.permute(0, 3, 1, 2).float() / 255.0)
        maps = (self.cnn(torch.relu(x * (1 + scale) + shift)).flatten(2) * self.keypoint_scale).softmax(-1)
        keypoints = torch.cat([maps @ self.grid_x, maps @ self.grid_y], dim=1)
        return keypoints, self.state_mlp((states - self.state_mean) / self.state_std), text

    def act(self, keypoints: torch.Tensor, state: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([keypoints, state, text], dim=1)).view(-1, self.horizon, self.dim)

    def unnormalise(self, actions: torch.Tensor) -> torch.Tensor:
        return actions * self.action_std + self.action_mean


@dataclass
class PolicyFiles:
    """A loaded policy: what its config says, the digests of its two files and the network."""
    name: str
    path: Path
    digests: dict[str, str]  # sha256 of config.json and model.safetensors: {"config": ..., "model": ...}
    action_horizon: int
    action_dim: int
    control_hz: float
    observation_spec: dict[str, dict]
    inputs: dict[str, str]  # {"image": key, "state": key, "prompt": key}
    network: ChunkPolicy = field(repr=False)
    forward: torch.jit.ScriptModule | ChunkPolicy = field(repr=False)  # the network, traced (trace)

    def metadata(self) -> dict:
        """What a server sends a client first (openpi's server metadata)."""
        return {"name": self.name, "action_horizon": self.action_horizon, "action_dim": self.action_dim,
                "control_hz": self.control_hz, "observation_spec": self.observation_spec,
                "model_sha256": self.digests["model"]}

    def predict(self, observations: list[dict]) -> np.ndarray:
        """One batched forward: [B, action_horizon, action_dim] float32 actions in action units. The
        observations are already checked against observation_spec. Safe to call from one thread while
        others run: it changes no state."""
        images, states, tokens, offsets = self.batch(observations)
        with torch.inference_mode():
            actions = self.network.unnormalise(self.forward(images, states, tokens, offsets))
        return actions.numpy()

    def batch(self, observations: list[dict]) -> tuple[torch.Tensor, ...]:
        """The network's inputs for a list of observations."""
        images = torch.from_numpy(np.stack([o[self.inputs["image"]] for o in observations]))
        states = torch.from_numpy(np.stack([o[self.inputs["state"]] for o in observations]))
        token_lists = [prompt_tokens(o[self.inputs["prompt"]], self.network.vocab_size) for o in observations]
        offsets = torch.tensor(np.cumsum([0] + [len(t) for t in token_lists[:-1]]), dtype=torch.long)
        tokens = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long)
        return images, states, tokens, offsets


def build_network(config: dict) -> ChunkPolicy:
    """A network of the config's architecture (weights initialised at random)."""
    spec, inputs = config["observation_spec"], config["architecture"]["inputs"]
    return ChunkPolicy(config["architecture"], spec[inputs["image"]]["shape"], spec[inputs["state"]]["shape"][0],
                       config["action_horizon"], config["action_dim"])


def save_policy(path: str | Path, config: dict, network: ChunkPolicy) -> None:
    """Write config.json and model.safetensors into the directory path (made if need be)."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in network.state_dict().items()}, str(path / MODEL_FILE))


def load_policy(path: str | Path, sha256: str | None = None, threads: int | None = None) -> PolicyFiles:
    """Load a policy directory. Refuses (ValueError naming the file) a model.safetensors whose sha256 is not
    the given one, a config.json that lacks a field or declares inputs it cannot have, and tensors that do
    not match the config's architecture. threads, when given, sets torch's intra-op threads for the whole
    process (torch.set_num_threads)."""
    from safetensors.torch import load as load_tensors
    path = Path(path)
    config_bytes, model_bytes = (path / CONFIG_FILE).read_bytes(), (path / MODEL_FILE).read_bytes()
    digests = {"config": hashlib.sha256(config_bytes).hexdigest(), "model": hashlib.sha256(model_bytes).hexdigest()}
    if sha256 is not None and sha256.lower().removeprefix("sha256:") != digests["model"]:
        raise ValueError(f"{path / MODEL_FILE}: sha256 {digests['model']}, expected {sha256}")
    config = _checked_config(json.loads(config_bytes), path / CONFIG_FILE)
    network = build_network(config)
    tensors = load_tensors(model_bytes)
    expected = {k: tuple(v.shape) for k, v in network.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in tensors.items()}
    if found != expected:
        wrong = sorted(set(found) ^ set(expected)) + sorted(k for k in found.keys() & expected.keys()
                                                            if found[k] != expected[k])
        raise ValueError(f"{path / MODEL_FILE}: tensors do not match the architecture of {CONFIG_FILE}: "
                         + ", ".join(f"{k} {found.get(k)} (expected {expected.get(k)})" for k in wrong))
    network.load_state_dict(tensors)
    network.eval()
    if threads is not None:
        torch.set_num_threads(threads)
    inputs, spec = config["architecture"]["inputs"], config["observation_spec"]
    return PolicyFiles(name=config.get("name") or path.name, path=path, digests=digests,
                       action_horizon=config["action_horizon"], action_dim=config["action_dim"],
                       control_hz=float(config["control_hz"]), observation_spec=spec, inputs=dict(inputs),
                       network=network, forward=trace(network, spec[inputs["image"]]["shape"],
                                                      spec[inputs["state"]]["shape"][0]))


def trace(network: ChunkPolicy, image_shape: list[int], state_dim: int) -> torch.jit.ScriptModule | ChunkPolicy:
    """The network as TorchScript, traced on one blank observation (its ops do not depend on the values, the
    batch size or the prompt's length; tests/policy/test_model.py checks it against the network). torch marks
    jit.trace deprecated in favour of torch.compile and torch.export, but neither runs a graph without Python
    between its ops short of compiling C++ at every start; where tracing fails, the network runs as it is."""
    example = (torch.zeros(1, *image_shape, dtype=torch.uint8), torch.zeros(1, state_dim),
               torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.trace(network, example, check_trace=False)
    except (AttributeError, RuntimeError) as exc:
        log.warning("the policy network runs untraced: %s", exc)
        return network


def _checked_config(config: dict, where: Path) -> dict:
    missing = [k for k in REQUIRED if k not in config]
    missing += [f"architecture.{k}" for k in ARCHITECTURE if k not in config.get("architecture", {k: 0})]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    spec, inputs = config["observation_spec"], config["architecture"]["inputs"]
    for key, s in spec.items():
        if not isinstance(s, dict) or s.get("dtype") not in DTYPES or not isinstance(s.get("shape"), list):
            raise ValueError(f"{where}: observation_spec[{key!r}] needs a shape list and a dtype of {list(DTYPES)}")
    wanted = {"image": ("uint8", 3), "state": ("float32", 1), "prompt": ("str", 0)}
    for role, (dtype, rank) in wanted.items():
        key = inputs.get(role)
        if key not in spec or spec[key]["dtype"] != dtype or len(spec[key]["shape"]) != rank:
            raise ValueError(f"{where}: architecture.inputs.{role} must name an observation_spec key of dtype "
                             f"{dtype} and rank {rank}, not {key!r}")
    for k in ("action_horizon", "action_dim"):
        if not isinstance(config[k], int) or config[k] < 1:
            raise ValueError(f"{where}: {k} must be a positive integer, not {config[k]!r}")
    return config


def _time_predict(path: str) -> None:
    """python -m inferd.policy.model DIR: predict's time at batch 1 and 16, one thread."""
    import time
    policy = load_policy(path, threads=1)
    rng = np.random.default_rng(0)
    spec = policy.observation_spec
    obs = {k: ("reach the red target" if s["dtype"] == "str" else
               rng.integers(0, 255, s["shape"]).astype(DTYPES[s["dtype"]])) for k, s in spec.items()}
    for batch in (1, 16):
        observations = [obs] * batch
        for _ in range(20):
            policy.predict(observations)
        start, n = time.perf_counter(), 200
        for _ in range(n):
            policy.predict(observations)
        print(f"batch {batch}: {(time.perf_counter() - start) / n * 1e3:.2f} ms a predict")


if __name__ == "__main__":
    import sys
    _time_predict(sys.argv[1])
