"""The project's tooling, beside the library packages and not shipped with them (pyproject.toml packages only
`configuration`, `modeling` and `vllm_integration`): the language-modelling and serving benchmarks, the helper that
starts and queries `vllm serve`, the commit a benchmark records, and the paged KV caches the kernel tests and benchmark
build. `scripts/` runs them from a checkout; the tests import them from the repository root."""
