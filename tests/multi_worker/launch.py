"""Runs a local cluster of ``worker.py`` processes on 127.0.0.1 and waits.

Usage: ``python launch.py --out-dir DIR [--workers N] [--timeout S] -- ARGS``

Worker i gets ``TF_CONFIG`` for task i of a cluster on free 127.0.0.1 ports,
is passed ``--out DIR/worker{i}.json ARGS`` and logs to ``DIR/worker{i}.log``.
Exits 0 when every worker exits 0 in time. Otherwise, or on any error here,
it kills the workers that still run, and exits 1. Run it in a network
namespace of its own (``unshare -rn``) to keep TensorFlow's gRPC servers,
which listen on every address of the host, off the real network.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

WORKER = Path(__file__).with_name("worker.py")
HOST = "127.0.0.1"


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now (held open until all are
    chosen, so the OS cannot hand out one twice)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((HOST, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def run_cluster(out_dir: Path, workers: int, timeout: float, args: list[str]) -> bool:
    """Starts the workers, waits up to ``timeout`` s; True if all exited 0."""
    cluster = {"worker": [f"{HOST}:{p}" for p in free_ports(workers)]}
    procs: list[subprocess.Popen] = []
    try:
        for i in range(workers):
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": i}}))
            with open(out_dir / f"worker{i}.log", "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(WORKER), "--out",
                     str(out_dir / f"worker{i}.json"), *args],
                    env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            # A dead worker leaves the other blocked in a collective: stop early.
            if time.monotonic() > deadline or any(p.returncode for p in procs):
                return False
            time.sleep(0.2)
        return all(p.returncode == 0 for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=75.0)
    parser.add_argument("worker_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args()
    if ns.workers < 1:
        parser.error(f"--workers must be >= 1, got {ns.workers}")
    args = ns.worker_args[1:] if ns.worker_args[:1] == ["--"] else ns.worker_args
    ok = run_cluster(ns.out_dir, ns.workers, ns.timeout, args)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
