"""Upcycle a Llama, Mistral or Qwen2 checkpoint into a hybrid; see modeling/upcycling.py (or `--help`) for what is
copied, what is new and what is checked.

    python scripts/upcycle.py SOURCE_DIR OUTPUT_DIR [--sliding-window W] [--full-attention-layers I,J,...] ...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modeling.upcycling import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
