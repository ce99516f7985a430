#!/usr/bin/env python
"""Write a universal checkpoint as a Megatron-LM checkpoint at any layout.

Same as `megatron-ucp from-universal UCP DST [...]` (see megatron_ucp/commands/from_universal.py); usable without
installing the package:
    python tools/convert_from_universal.py UCP DST --tensor-model-parallel-size 1 \
        --pipeline-model-parallel-size 2 --data-parallel-size 2 --use-distributed-optimizer --ckpt-format torch
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ucp.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["from-universal", *sys.argv[1:]]))
