"""Every private torch API macroarch touches, one named shim per concern.

Each shim imports what it needs lazily (never at ``import macroarch``), checks the torch release against the one
range ``version`` holds (pyproject's; ``version.check`` warns once outside it), and falls back or raises
``version.missing``'s error, which names the private name and the release, when the name has moved.
``tests/test_private_api.py`` lists every private torch name in the package and fails on one outside
``macroarch/_compat``.

- ``version``: the supported range (pyproject's ``torch>=2.13,<2.15``), the release running, the warning for an
  untested one and the error that names a moved private name;
- ``autograd``: the running backward pass's id and a callback at its end (DGR, the bucketer, gradient records),
  the order of graph nodes (DGR's grouping) and whether a tensor is a view (DGR's queued gradients);
- ``memtracker``: MemTracker reporting every change to a tracked storage (``measure.memory.measured``);
- ``fake``: ``FakeTensorMode`` and ``is_fake`` (full-size models measured without memory);
- ``dispatch``: the ``TorchDispatchMode`` base of ``measure.hardware.OpCounter``, and the tensors of an op's arguments;
- ``cpu``: oneDNN's and torch's bf16/fp16 probes, with public fallbacks (``measure.machine``; never raises);
- ``distributed``: the default process group's store (``measure.comm_bench``'s dead-rank demonstration) and the
  buckets DDP rebuilt (``comm.bucketer.ddp_bucket_bytes``);
- ``subclass``: the tensor-subclass machinery of ``MVASWeight``, its linear layer and ``MVASAdamW`` (the wrapper
  constructor, the dispatch-mode stack, the two ATen ops with private names it must recognise), and torch
  functions off for bookkeeping on parameters (DGR's ``.grad`` access);
- ``compile``: the private ``torch.compile`` settings the MVAS kernels compile under.
"""
