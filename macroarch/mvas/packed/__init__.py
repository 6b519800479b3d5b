"""Packed storage: ``PackedTensor`` and ``pack`` (``packed_tensor``), the managed weight ``MVASWeight`` with its FSDP2
protocol methods (``weight``), and its one-node linear layer (``linear``)."""
