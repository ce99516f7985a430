"""One rank of a `torchrun` typed in a documentation block (tests/test_doc_commands.py), forked by the suite's
fork server (tests/zygote.py), which starts every rank in the repository: this moves the rank to the directory
the command was typed in, then runs the script as `python SCRIPT ARGS...` there would.

    doc_torchrun_rank.py CWD SCRIPT ARGS...
"""

import os
import runpy
import sys

cwd, script, *args = sys.argv[1:]
os.chdir(cwd)
sys.argv = [script, *args]
sys.path[0] = os.path.dirname(os.path.abspath(script))
runpy.run_path(script, run_name="__main__")
