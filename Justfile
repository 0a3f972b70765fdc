# bankml serve: common tasks. `just` lists them.

default:
    @just --list

# install bankml with its test dependencies (editable)
setup:
    python3 -m pip install -e '.[test]'

# serve the default model (SmolLM2-135M-Instruct Q4_1) on 127.0.0.1:18093
serve *ARGS:
    bankml serve --native {{ARGS}}

# the test suite (what .ci/run runs)
test *ARGS:
    python3 -m pytest -q {{ARGS}}

# benchmarks, each printing JSON
bench:
    python3 bench/hash.py
    python3 bench/decode.py

lint:
    ruff check .
    ruff format --check .
