"""Before a GPU run: will every device step find what it imports? Answered here, on the CPU, in seconds.

    python bench/gpu_preflight.py            # JSON; exit 1 if a device module cannot be imported

The GPU machine has no package registry: it has its image's packages (bench/gpu_image.txt, from the
device library's KINDS.md) and the wheels we carry (bench/gpu_wheels.txt), nothing else. `restrict()`
makes this process see the same: an import of a top-level module that belongs to neither, nor to the
standard library or this project, fails with ModuleNotFoundError naming the lists. Then `main` imports
every module the device steps import (DEVICE_MODULES), so a module that needs llguidance or sanic at
import time fails here, not there. The dry run (`bench/gpu_run.sh OUT --cpu-dry-run`) runs every step
under the same restriction through bench/preflight_site/sitecustomize.py (BANKML_GPU_RESTRICT=1), so an
import made only on some path is caught too.

Versions are not emulated: here is whatever jax and triton are installed; the device has jax 0.11.2 and
triton 3.6.0 (gpu_image.txt's header).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import json
import re
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
TESTS = ROOT / "tests"
IMAGE_LIST = BENCH / "gpu_image.txt"
WHEEL_LIST = BENCH / "gpu_wheels.txt"

# What the device steps import (bench/gpu_run.py's steps); jax_triton is found, not imported: on a CPU
# jaxlib its import fails (no GPU plugin), on the device it is the smoke's first import.
DEVICE_MODULES = (
    "bankml.cli", "bankml.verify", "bankml.pin", "bankml.default_model",
    "kernels.ops", "kernels.qlayout", "kernels.paged_attention", "kernels.kvquant",
    "kernels.triton.call", "kernels.triton.qmatmul", "kernels.triton.attention",
    "model.engine", "model.messages", "model.config", "model.kvcache", "model.tokenizer_gguf", "model.weights",
    "gpu_monitor.sample", "gpu_monitor.nvml", "gpu_monitor.energy",
    "synth_gguf", "gpu", "gpu_smoke", "gpu_usage_sample", "gpu_report_plugin",
    "pytest", "gguf", "numpy", "jax", "triton", "pynvml",
)
FOUND_ONLY = ("jax_triton",)
TEST_FILES = ("test_gpu_kernels.py", "test_gpu_monitor_device.py")


def _names(path: Path) -> set[str]:
    """Distribution names in a list file (one per line, `name==version` or bare; # comments), normalized."""
    out = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.add(normalize(re.split(r"[=<>!~ ;\[]", line, maxsplit=1)[0]))
    return out


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def allowed_distributions() -> set[str]:
    return _names(IMAGE_LIST) | _names(WHEEL_LIST) | {"bankml"}


def project_modules() -> set[str]:
    """Top-level names this checkout provides: its packages, and the bench/ and tests/ scripts the steps
    put on the path."""
    names = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} | {"bench", "tests"}
    for folder in (BENCH, TESTS):
        names |= {p.stem for p in folder.glob("*.py")}
    return names


class Restriction(importlib.abc.MetaPathFinder):
    """Refuses a top-level import whose distribution is not on the GPU machine."""

    def __init__(self) -> None:
        self.allowed = allowed_distributions()
        self.project = project_modules()
        self.owners = {m: {normalize(d) for d in ds} for m, ds in importlib.metadata.packages_distributions().items()}
        self.refused: list[str] = []

    def permits(self, name: str) -> bool:
        if name in sys.stdlib_module_names or name in sys.builtin_module_names or name in self.project:
            return True
        if name.startswith("__editable__"):  # pip's finder for this project installed with -e
            return True
        owners = self.owners.get(name)
        if owners is None:  # a module of no distribution: not pip's, so not the image's either
            return False
        return bool(owners & self.allowed)

    def find_spec(self, name, path=None, target=None):
        if "." in name or self.permits(name):
            return None  # the normal finders go on
        spec = next((sp for f in sys.meta_path if f is not self for sp in [_spec(f, name)] if sp), None)
        if spec is None:
            return None  # not installed here either: the normal "No module named"
        if _in_stdlib(spec):
            return None  # the standard library's private modules (_sysconfigdata_..., lib-dynload)
        self.refused.append(name)
        raise ModuleNotFoundError(f"No module named {name!r} on the GPU machine: not in its image "
                                  f"(bench/gpu_image.txt) nor among the carried wheels (bench/gpu_wheels.txt)",
                                  name=name)


def _spec(finder, name: str):
    try:
        return finder.find_spec(name, None)
    except (AttributeError, ImportError, ValueError):
        return None


_STDLIB = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")})


def _in_stdlib(spec) -> bool:
    origin = spec.origin or ""
    return origin.startswith(_STDLIB) and "site-packages" not in origin and "dist-packages" not in origin


def restrict() -> Restriction:
    """From now on this process imports only what the GPU machine has. Idempotent."""
    for finder in sys.meta_path:
        if isinstance(finder, Restriction):
            return finder
    finder = Restriction()
    sys.meta_path.insert(0, finder)
    return finder


def check_imports() -> list[dict]:
    # the project first (bench/gateway.py must not hide the gateway package), then the scripts' folders
    sys.path[:0] = [str(ROOT)]
    sys.path += [str(BENCH), str(TESTS)]
    rows = []
    for name in DEVICE_MODULES:
        t0 = time.perf_counter()
        try:
            importlib.import_module(name)
            rows.append({"module": name, "ok": True, "seconds": round(time.perf_counter() - t0, 2)})
        except BaseException as e:  # noqa: B036 -- a module's SystemExit is its failure too
            rows.append({"module": name, "ok": False, "reason": f"{type(e).__name__}: {e}"})
    for name in FOUND_ONLY:
        found = importlib.util.find_spec(name) is not None
        rows.append({"module": name, "ok": found, "found_only": True,
                     **({} if found else {"reason": f"{name} is not installed here (bench/gpu_wheels.txt carries it)"})})
    for test in TEST_FILES:  # collected as pytest collects them: module-level imports only
        spec = importlib.util.spec_from_file_location(f"preflight_{Path(test).stem}", TESTS / test)
        try:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            rows.append({"module": f"tests/{test}", "ok": True})
        except BaseException as e:  # noqa: B036 -- pytest.skip at import is a failure here too
            rows.append({"module": f"tests/{test}", "ok": False, "reason": f"{type(e).__name__}: {e}"})
    return rows


def main() -> int:
    finder = restrict()
    rows = check_imports()
    out = {"python": sys.version.split()[0], "ok": all(r["ok"] for r in rows),
           "refused_imports": sorted(set(finder.refused)), "modules": rows}
    print(json.dumps(out, indent=1))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
