"""One rank of a ``macroarch.comm.launch``: ``python -m macroarch.comm._rank <spec.json>``.

Sets the torch threads, joins the gloo process group through ``env://`` (torchrun's variables, set by the
launcher) with the spec's timeout, calls the target and writes its JSON result where the launcher reads it.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
from pathlib import Path


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    module_name, function_name = spec["target"].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["pg_timeout"]))
    rank = dist.get_rank()
    result = function(**spec["kwargs"])
    out = Path(spec["out"]) / f"rank{rank}.json"
    out.with_suffix(".partial").write_text(json.dumps(result))
    os.replace(out.with_suffix(".partial"), out)
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: destructors of torch's C++ threads (gloo, the store client)
    # running during it abort the process now and then ("terminate called without an active exception"),
    # after the result has been written. Everything that matters is on disk by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
