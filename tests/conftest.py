import os
import tempfile
from pathlib import Path

# Loaded GGUF files are cached per digest (inferd.models.gguf_cache): the tests (and the servers they start)
# share one cache of their own, never the user's.
os.environ.setdefault("INFERD_CACHE_DIR", str(Path(tempfile.gettempdir()) / "inferd-test-cache"))
