"""The README's flow in one process with vLLM's default settings, as a user's script runs it: build a ~1B hybrid on
the CPU, `save_pretrained`, convert it for vLLM, start `LLM()` (vLLM forks its engine from this process) and
generate. It once hung forever in `LLM()` (upstream_fixes.py, fix 4); `scripts/device_check.sh startup` runs it on
the GPU under a time limit, so that a hang fails the check instead of going unnoticed.

    python3 scripts/check_engine_start.py OUT_DIR        # on a CUDA machine with vLLM
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configuration import HybridConfig  # noqa: E402
from modeling import HybridForCausalLM  # noqa: E402
from vllm_integration.convert import main as convert  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {message}", flush=True)

    config = HybridConfig(hidden_size=2048, num_hidden_layers=24, sliding_window=2048, max_position_embeddings=33000)
    model = HybridForCausalLM(config).to(torch.bfloat16)
    log(f"built a {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B hybrid on the CPU")
    model.save_pretrained(args.out_dir / "hf")
    del model
    log("saved")
    if convert([str(args.out_dir / "hf"), str(args.out_dir / "vllm"), "--dtype", "bfloat16", "--force"]) != 0:
        return 1
    log(f"converted; CUDA initialised in this process: {torch.cuda.is_initialized()}")

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(args.out_dir / "vllm"),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=33000,
        gpu_memory_utilization=0.85,
    )
    log("engine ready")
    prompts = [{"prompt_token_ids": list(range(1, 1 + length))} for length in (7, 300, 4100)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False))
    lengths = [len(output.outputs[0].token_ids) for output in outputs]
    log(f"generated {lengths} tokens")
    return 0 if lengths == [16, 16, 16] else 1


if __name__ == "__main__":
    sys.exit(main())
