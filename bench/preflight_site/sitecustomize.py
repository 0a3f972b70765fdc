"""On PYTHONPATH with BANKML_GPU_RESTRICT=1 (bench/gpu_run.sh --cpu-dry-run puts it there): every Python
process of the dry run imports only what the GPU machine has (bench/gpu_preflight.py's `restrict`).
Loaded from its file, so bench/ never goes on the path (its gateway.py would hide the gateway package)."""

import os

if os.environ.get("BANKML_GPU_RESTRICT") == "1":
    import importlib.util

    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu_preflight.py")
    _spec = importlib.util.spec_from_file_location("bankml_gpu_preflight", _path)
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    _module.restrict()
