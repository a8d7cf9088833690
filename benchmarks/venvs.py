"""The peers' virtual environments, under benchmarks/.venvs/ (ignored by git), created on first use."""
import shutil
import subprocess
import sys
from pathlib import Path


def ensure_venv(venv: Path, packages: list[str], note: str = "") -> Path:
    """venv's python; if venv is absent, first creates it with python3.11 and pip-installs packages into it."""
    python = venv / "bin" / "python"
    if python.exists():
        return python
    print(f"{venv} not found: creating it and installing {' '.join(packages)} into it{note}", flush=True)
    try:
        subprocess.run(["python3.11", "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", *packages], check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        shutil.rmtree(venv, ignore_errors=True)  # so that the next run tries again rather than using half a venv
        sys.exit(f"could not create {venv}: {e}")
    return python
