"""`bankml serve FILE --fork F [--spawn BIN | --upstream H:P] ...` in P0 mode, for the tests.

Exactly what the `bankml serve` command runs (bankml.cli.main), started with this checkout's Python
so the tests need no installed console script.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bankml.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
