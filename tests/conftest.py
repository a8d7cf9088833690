import json
import logging
import os
import tempfile
from pathlib import Path

import pytest

# Loaded GGUF files are cached per digest (inferd.models.gguf_cache): the tests (and the servers they start)
# share one cache of their own, never the user's.
os.environ.setdefault("INFERD_CACHE_DIR", str(Path(tempfile.gettempdir()) / "inferd-test-cache"))
# Two pytest workers, each with its servers, share the cores: OpenMP threads that spin-wait between parallel
# regions (libgomp's default) take the cores other processes' steps need. Waiting passively, the gateway e2e and
# batch modules run in 104-116 s instead of 148-172 s under `-n 2` on 2 cores. Servers inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SMOLLM2_KEY = "sk-e2e-secret"
SMOLLM2_ADMIN_KEY = "admin-e2e-secret"
SMOLLM2_MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory):
    """One plain `inferd serve` (SmolLM2, float32, the packaged all-MiniLM-L6-v2, the demo iris-classifier and
    the demo reacher policy)
    shared by the modules that need nothing more of it: its URL and its log. Each server start costs CI ~20 s."""
    from tests.server import running_server
    log_path = tmp_path_factory.mktemp("smollm2") / "serve.log"
    with running_server(log_path, "--api-key", SMOLLM2_KEY, "--admin-key", SMOLLM2_ADMIN_KEY, "--max-model-len",
                        str(SMOLLM2_MAX_MODEL_LEN), "--kv-cache-gib", "0.25", embeddings=True, classical=True,
                        policy=True) as url:
        yield url, log_path


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """A test that runs the CLI in process has it set up logging on that test's captured stderr; the root logger is
    put back after it, so that later tests in the worker do not log to a closed stream."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def pytest_collection_modifyitems(items):
    """The order pytest-xdist hands out modules in (`make test` passes --no-loadscope-reorder, so it keeps this
    one): the longest first, by tests/durations.json (a module it lacks counts as a short one), so that no long
    module is left to run alone on one worker at the end. The vLLM module, the longest, waits for CI's install of
    vLLM if it has not ended yet."""
    seconds = json.loads((Path(__file__).with_name("durations.json")).read_text())
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 1.0))
