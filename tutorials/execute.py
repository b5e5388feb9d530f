"""Runs the tutorials at their normal size and stores their outputs and plots.

    python -m tutorials.execute                      # every notebook
    python -m tutorials.execute 01_quickstart 02     # some (a name's start is enough)

Each notebook runs top to bottom in a fresh kernel of this interpreter, in a
scratch folder (what it writes stays there), without ``KERAS_MP_SMOKE``, so on
the whole data set. Its outputs are written back into the ``.ipynb`` with, in
each code cell's metadata, the SHA-256 of the source that produced them
(``keras_mp.source_sha256``); ``tests/test_tutorials.py`` fails when a cell's
source no longer matches, so stale outputs cannot stay. TensorFlow's log
(stderr, and its ``INFO:tensorflow:`` lines) is left out of the stored
outputs, and so are execution times.

The tests themselves run every notebook in smoke mode and leave the files
alone.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["KERNEL", "NOTEBOOKS", "clean", "kernel", "run", "source_hash", "stale_cells"]

TUTORIALS = Path(__file__).resolve().parent
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))
#: The kernel the notebooks run in: this interpreter, under a name of its own.
KERNEL = "keras-mp-tutorials"
META = "keras_mp"


def source_hash(source: str) -> str:
    """The SHA-256 of a code cell's source, as stored with its outputs.

    >>> source_hash("print(1)")[:12]
    'd287bb7f9d15'
    """
    return hashlib.sha256(source.encode()).hexdigest()


def stale_cells(nb) -> list[int]:
    """Indices of the code cells whose stored outputs did not come from their
    current source (no hash, or another one)."""
    return [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            and cell.metadata.get(META, {}).get("source_sha256") != source_hash(cell.source)]


@contextlib.contextmanager
def kernel(env: dict[str, str] | None = None) -> Iterator[dict[str, str]]:
    """A kernelspec for this interpreter under a scratch ``JUPYTER_PATH``
    (found before any other "python3" on the machine); yields the
    environment to run the notebooks with (``os.environ``, ``env``, and that
    path)."""
    with tempfile.TemporaryDirectory() as root:
        spec = Path(root) / "kernels" / KERNEL
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "keras-mp", "language": "python"}))
        yield {**os.environ, **(env or {}), "JUPYTER_PATH": root}


_TF_LOG = re.compile(r"^(INFO|WARNING):tensorflow:.*\n?", re.MULTILINE)


def clean(outputs: list) -> list:
    """The outputs stored: without stderr streams (TensorFlow's native log)
    and without TensorFlow's Python log lines (``INFO:tensorflow:...``)."""
    kept = []
    for output in outputs:
        if output.output_type == "stream":
            if output.name == "stderr":
                continue
            output.text = _TF_LOG.sub("", output.text)
            if not output.text:
                continue
        kept.append(output)
    return kept


def run(path: Path, timeout: int = 1200) -> float:
    """Executes one notebook at its normal size and stores its outputs;
    returns the seconds it took."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    with kernel() as kernel_env, tempfile.TemporaryDirectory() as scratch:
        kernel_env.pop("KERAS_MP_SMOKE", None)  # the normal size
        kernel_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(kernel_env)  # the kernel inherits this process's environment
        try:
            t0 = time.perf_counter()
            nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=timeout,
                                    resources={"metadata": {"path": scratch}}).execute()
            seconds = time.perf_counter() - t0
        finally:
            os.environ.clear()
            os.environ.update(saved)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.outputs = clean(cell.outputs)
        cell.metadata.pop("execution", None)
        cell.metadata[META] = {"source_sha256": source_hash(cell.source)}
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebooks to run (a name's start); "
                        "default: all")
    args = parser.parse_args(argv)
    chosen = [p for p in NOTEBOOKS if not args.names
              or any(p.name.startswith(n) for n in args.names)]
    if not chosen:
        parser.error(f"no notebook starts with {args.names}; there are "
                     f"{[p.stem for p in NOTEBOOKS]}")
    for path in chosen:
        print(f"{path.name}: running at its normal size ...", flush=True)
        print(f"{path.name}: {run(path):.0f} s, outputs stored", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
