"""MVAS with the rest of torch: FSDP2 sharding (``fsdp``), ``torch.distributed.checkpoint`` (``dcp``), and dense and
packed state dicts and files (``checkpoint``)."""
