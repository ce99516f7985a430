#!/usr/bin/env python
"""Convert a Megatron-LM checkpoint into a universal checkpoint.

Same as `megatron-ucp to-universal SRC DST [...]` (see megatron_ucp/convert.py); usable without
installing the package: python tools/convert_to_universal.py SRC DST --workers 4
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ucp.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["to-universal", *sys.argv[1:]]))
