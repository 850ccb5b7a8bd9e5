"""`python -m vllm_transformers_overlay`: print which backend implementation is active
(exit status 1, with the reason, when `VLLM_TRANSFORMERS_BACKEND` is invalid)."""

import sys

from vllm_transformers_overlay import describe

try:
    print(describe())
except ImportError as error:
    sys.exit(f"Transformers modeling backend: none ({error})")
