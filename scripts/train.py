"""Train a hybrid model from a config, fine-tune a checkpoint, or distil a teacher into it; see modeling/training.py
(or `--help`).

    python scripts/train.py --output-dir outputs/recall
    python scripts/train.py --model outputs/upcycled --teacher SOURCE_DIR --text-file corpus.txt --train ssm ...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modeling.training import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
