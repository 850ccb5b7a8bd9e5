"""`python -m vllm_transformers_overlay`: print which backend implementation is active."""

from vllm_transformers_overlay import describe

print(describe())
