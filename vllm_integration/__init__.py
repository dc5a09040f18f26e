"""vLLM plugin for the hybrid model (entry point `vllm.general_plugins`: `vllm_integration:register`).

Plugins load in every vLLM process, so `register` is idempotent and imports nothing heavy: the model class is
registered lazily by name.
"""


def register() -> None:
    from vllm import ModelRegistry

    import configuration  # noqa: F401  (registers model_type "hybrid" with AutoConfig, for vLLM's config loading)
    from configuration.versions import check_vllm

    check_vllm()  # an unsupported vLLM fails here, by name, before it loads a model

    from .upstream_fixes import (
        bound_max_token_id,
        check_prompt_token_ids,
        release_openmp_threads_before_fork,
    )

    bound_max_token_id()
    check_prompt_token_ids()
    release_openmp_threads_before_fork()

    if "HybridForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("HybridForCausalLM", "vllm_integration.model:HybridForCausalLM")
