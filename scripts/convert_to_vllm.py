"""Convert a Transformers checkpoint of the hybrid model into the checkpoint vLLM loads; see
vllm_integration/convert.py (or `--help`) for what changes and what is checked.

    python scripts/convert_to_vllm.py HF_DIR OUT_DIR [--dtype bfloat16|float16|float32] [--force]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_integration.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
