"""pretrain_scripts/pretrain_gpt.py whose first torch_dist save stops half-way, for tests that kill a job there.

Every rank writes its .distcp files as usual; the coordinator (rank 0), about to write DCP's `.metadata` (megatron-core's
FileSystemWriterAsync.finish), writes its process id to $MEGATRON_UCP_TEST_SAVE_MARKER instead and waits, so a
test finds the job inside its save (data files written, the checkpoint's metadata and the tracker not) and kills it.

    torchrun --nproc-per-node N tests/save_killed_script.py <Megatron-LM flags> --save DIR --save-interval 1
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ucp.megatron_lm.pretrain_gpt import main  # noqa: E402  (installs the import patches)


def _stop_inside_the_save() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    marker = Path(os.environ["MEGATRON_UCP_TEST_SAVE_MARKER"])

    def finish(self, metadata, results):
        marker.write_text(str(os.getpid()))
        while True:  # until the test kills the job
            time.sleep(1)

    filesystem_async.FileSystemWriterAsync.finish = finish


if __name__ == "__main__":
    _stop_inside_the_save()
    main()
