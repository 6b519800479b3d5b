"""Give every notebook the metadata JupyterLab writes when it opens it, so opening one does not mark it modified.

Cause (found in headless Chromium, JupyterLab 4.6): when the kernel connects, JupyterLab replaces the notebook's
``metadata.language_info`` with the kernel's ``kernel_info`` reply (codemirror_mode, file_extension, mimetype,
name, nbconvert_exporter, pygments_lexer, version) and ``metadata.kernelspec`` with the kernelspec's name,
display_name and language. The committed notebooks held ``language_info: {"name": "python"}`` only, so every
open changed the model: the tab showed the modified dot, and a save (autosave) wrote the new metadata.

This script asks the project's kernel (the kernelspec the Makefile installs, ``--name`` read from the Makefile)
for its ``kernel_info`` and writes both fields into each notebook given (default: notebooks/*.ipynb), with
nbformat's own layout (the committed files round-trip through ``nbformat.writes`` unchanged), touching nothing
else. ``language_info.version`` is this interpreter's Python version: a kernel of another patch release reports
another one, and JupyterLab would mark the notebooks modified there.

Usage, from the repository root: ``make nbmeta`` (= ``.venv/bin/python -m macroarch.repro.nbmeta``), after a Python
upgrade of ``.venv``; ``python -m macroarch.repro.nbmeta [--check] [NOTEBOOK ...]``.
``--check`` changes nothing and exits 1 listing the notebooks that differ.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import start_new_kernel


def makefile_kernel_name(makefile: Path) -> str:
    names = re.findall(r"ipykernel install .*--name\s+(\S+)", makefile.read_text())
    if len(set(names)) != 1:
        raise SystemExit(f"{makefile}: expected one `ipykernel install ... --name NAME`, found {names}")
    return names[0]


def kernel_metadata(name: str) -> dict:
    """``{"kernelspec": ..., "language_info": ...}`` as JupyterLab writes them for kernel ``name``."""
    spec = KernelSpecManager().get_kernel_spec(name)  # KeyError (NoSuchKernel) if `make venv` has not installed it
    manager, client = start_new_kernel(kernel_name=name)
    try:
        reply = client.kernel_info(reply=True, timeout=60)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return {"kernelspec": {"display_name": spec.display_name, "language": spec.language, "name": name},
            "language_info": reply["content"]["language_info"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if any notebook differs")
    parser.add_argument("--makefile", type=Path, default=Path("Makefile"))
    args = parser.parse_args()
    paths = args.notebooks or sorted(Path("notebooks").glob("*.ipynb"))
    wanted = kernel_metadata(makefile_kernel_name(args.makefile))
    differ = []
    for path in paths:
        text = path.read_text()
        nb = nbformat.reads(text, as_version=nbformat.NO_CONVERT)
        for key, value in wanted.items():
            nb.metadata[key] = value
        new = nbformat.writes(nb) + "\n"
        if new != text:
            differ.append(path)
            if not args.check:
                path.write_text(new)
    verb = "differ" if args.check else "rewritten"
    print(f"{len(differ)} of {len(paths)} notebooks {verb}: {', '.join(map(str, differ)) or '-'}")
    print(f"metadata: {wanted}")
    return 1 if args.check and differ else 0


if __name__ == "__main__":
    sys.exit(main())
