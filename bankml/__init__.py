"""bankml: a verifying, GPU-first inference server for GGUF models.

The `bankml` package is the gate (guard, pin, verify), the CLI and the configuration. It imports
neither jax nor sanic, so `bankml guard`, `sha256`, `pin` and `verify` start in well under a second.
"""

__version__ = "0.5.0"
