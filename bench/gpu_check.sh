#!/usr/bin/env bash
cd "$(dirname "$0")/.." && exec "$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )" -m bench.gpu_check "$@"
