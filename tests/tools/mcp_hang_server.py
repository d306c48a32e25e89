"""A stdio "MCP server" that never answers the handshake, for the tests: it starts a child that sleeps,
writes ``<its pid> <the child's pid>`` to the file named by its argument, and sleeps ``--seconds`` (60)
without reading its stdin, so closing that stdin does not end it; only a signal does."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("pid_file")
parser.add_argument("--seconds", type=float, default=60.0)
args = parser.parse_args()
child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({args.seconds})"])
with open(args.pid_file + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}\n")
os.replace(args.pid_file + ".tmp", args.pid_file)  # whole, or not there yet
print("hang server: answering nothing", file=sys.stderr, flush=True)
time.sleep(args.seconds)
