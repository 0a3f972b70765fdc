"""The README's code blocks, run as a reader runs them, against a server started as the README starts it.

Every ```sh / ```bash / ```shell and ```python block of README.md is one test, named by the line its
fence opens on. One `bankml serve --native --registry models --slot-dir slots` (the README's own flags)
serves the whole module from a scratch directory that holds what the README's commands name
(`my-model.gguf`, a tiny GGUF; `models/`; `slots/`). It serves the default model, SmolLM2, fetched
once as `bankml serve` fetches it. The README's ports (18093, 18092) are rewritten to the ports the
system gave that server, so a server a person left running on 18093 is neither used nor disturbed.

A shell block's `bankml serve ...` line whose flags the module's server already has is that server; any
other (your own model's) is started for real on ports of its own, and the block's later lines talk to
it. A block the README marks `<!-- readme-test: skip (REASON) -->` (a GPU, another machine, Ray, a
second slow server) and an install line (`pip install`) are reported as skipped with the reason.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from gateway_helpers import CliServer, _Server, free_port, tiny_model

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
ERRORS = ROOT / "docs" / "errors.md"
RUN = {"sh": "shell", "bash": "shell", "shell": "shell", "python": "python"}
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*\((.*)\)\s*-->")
BLOCK_TIMEOUT_S = 240
MODULE_FLAGS = ["--native", "--registry", "models", "--slot-dir", "slots"]  # the README's, as it writes them

pytestmark = pytest.mark.timeout(900)


@dataclass(frozen=True)
class Block:
    line: int  # the opening fence's line in README.md
    kind: str  # "shell" or "python"
    code: str
    skip: str | None  # why it is not run, or None


def readme_blocks(text: str) -> list[Block]:
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = re.fullmatch(r"```(\w*)\s*", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if lang in RUN:
            before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            marked = SKIP.search(before)
            code = "\n".join(lines[start + 1:end]) + "\n"
            skip = marked.group(1) if marked else None
            if skip is None and "pip install" in code:
                skip = "installs packages"
            blocks.append(Block(start + 1, RUN[lang], code, skip))
        i = end + 1
    return blocks


BLOCKS = readme_blocks(README.read_text())


def _params():
    for b in BLOCKS:
        marks = [pytest.mark.skip(reason=f"README.md line {b.line}: {b.skip}")] if b.skip else []
        yield pytest.param(b, id=f"line{b.line}-{b.kind}", marks=marks)


@dataclass
class Setup:
    work: Path  # the reader's directory
    server: CliServer

    def for_port(self, code: str, port: int, upstream_port: int) -> str:
        return code.replace("18093", str(port)).replace("18092", str(upstream_port))


@pytest.fixture(scope="module")
def setup(tmp_path_factory, bankml_cmd, smollm2_path):
    # smollm2_path: the default model, fetched once as `bankml serve` fetches it (skipped where it cannot
    # be had, failed in CI); a tiny random model would not do, as the README's grammar-constrained
    # examples (a City, a tool call, the agent's turns) need a model that ends its answers
    work = tmp_path_factory.mktemp("reader")
    tiny_model(work, "my-model.gguf")  # the README's "your own model": a tiny GGUF starts in seconds
    (work / "models").mkdir()
    (work / "slots").mkdir()
    server = CliServer(bankml_cmd, "--registry", str(work / "models"), "--slot-dir", str(work / "slots"),
                       timeout_s=600)
    try:
        yield Setup(work, server)
    finally:
        server.stop()


def _logical_lines(code: str) -> list[str]:
    return code.replace("\\\n", " ").split("\n")


def _serve_args(line: str) -> list[str] | None:
    """The flags of a `bankml serve` line (after any VAR=value words), or None for any other line."""
    words = shlex.split(line, comments=True)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    return words[2:] if words[:2] == ["bankml", "serve"] else None


def _run(argv: list[str], work: Path, line: int, stderr_tail: int | None = None) -> None:
    """Run a block (bash or Python) in the reader's directory; a failure names its README line."""
    try:
        done = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"README.md line {line}: the block ran past {BLOCK_TIMEOUT_S} s")
    if done.returncode:
        stderr = done.stderr if stderr_tail is None else done.stderr[-stderr_tail:]
        pytest.fail(f"README.md line {line}: exit {done.returncode}\n--- stdout\n{done.stdout}\n"
                    f"--- stderr\n{stderr}")


def _bash(script: str, work: Path, line: int) -> None:
    script = script.replace("curl -s ", "curl -s --fail-with-body ")  # an HTTP error fails the block
    _run(["bash", "-e", "-c", script], work, line)


def _run_shell(block: Block, setup: Setup, bankml_cmd: list[str]) -> None:
    lines = _logical_lines(block.code)
    starts = [i for i, ln in enumerate(lines)
              if (args := _serve_args(ln)) is not None and not set(args) <= set(MODULE_FLAGS)]
    if not starts:  # every serve line (if any) is the module's server: it is already listening
        script = "\n".join("true  # the module server runs with these flags" if _serve_args(ln) is not None else ln for ln in lines)
        _bash(setup.for_port(script, setup.server.port, setup.server.upstream_port), setup.work, block.line)
        return
    assert len(starts) == 1, f"README.md line {block.line}: one server start a block"
    at = starts[0]
    _bash("\n".join(lines[:at]), setup.work, block.line)
    port, upstream = free_port(), free_port()
    cmd = [*bankml_cmd, *shlex.split(lines[at], comments=True)[1:], "--listen", f"127.0.0.1:{port}",
           "--upstream", f"127.0.0.1:{upstream}"]
    try:  # in the reader's directory: the block's paths are relative to it
        server = _Server(cmd, 600, cwd=setup.work)
    except RuntimeError as e:
        pytest.fail(f"README.md line {block.line + 1 + at}: {e}")
    try:
        _bash(setup.for_port("\n".join(lines[at + 1:]), port, upstream), setup.work, block.line)
    finally:
        server.stop()


def _run_python(block: Block, setup: Setup) -> None:
    path = setup.work / f"readme_line{block.line}.py"
    path.write_text(setup.for_port(block.code, setup.server.port, setup.server.upstream_port))
    _run([sys.executable, str(path)], setup.work, block.line, stderr_tail=4000)


@pytest.mark.slow  # a real model's server, and its answers
@pytest.mark.parametrize("block", list(_params()))
def test_readme_block(block: Block, setup: Setup, bankml_cmd):
    if block.kind == "shell":
        _run_shell(block, setup, bankml_cmd)
    else:
        _run_python(block, setup)


def test_the_readme_has_blocks_of_each_kind():
    kinds = {b.kind for b in BLOCKS if not b.skip}
    assert kinds == {"shell", "python"}
    assert not [b.line for b in BLOCKS if b.skip == ""], "a skip marker without its reason"


def test_the_quick_start_test_line_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().split("\n")[-1]
    quick_start = next(b for b in BLOCKS if "bankml serve --native" in b.code and "pip install" in b.code)
    assert ci in quick_start.code.split("\n"), (ci, quick_start.code)


def test_docs_configuration_lists_every_key():
    """docs/configuration.md's tables name every field of bankml/config.py's four tables, and no other."""
    from bankml import config

    text = CONFIGURATION.read_text()
    for table, cls in [("serve", config.ServeConfig), ("limits", config.LimitsConfig),
                       ("engine", config.EngineConfig), ("registry", config.RegistryConfig)]:
        section = text.split(f"### [{table}]\n", 1)[1].split("\n#", 1)[0]
        documented = re.findall(r"^\| `(\w+)` \|", section, re.M)
        assert documented == [f.name for f in dataclasses.fields(cls)], table


def test_docs_errors_is_the_error_table():
    """docs/errors.md's table is bankml/errors.py's: every class, its statuses, its type, its exit code."""
    from bankml import errors

    rows = re.findall(r"^\| `(\w+)` \| (\d+) \| (\d+) \| (\d+) \| `(\w+)` \| (\d+) \|", ERRORS.read_text(), re.M)
    table = {cls.__name__: (str(c.openai), str(c.llama), str(c.ollama), c.type, str(c.exit_code))
             for cls, c in errors.TABLE.items()}
    assert {name: tuple(rest) for name, *rest in rows} == table
