"""Third-party noise that macroarch's own imports trigger and a user cannot act on, filtered by source and message.

One source today: torch's pytree logger (``torch.utils._pytree``) warns "<enum ...> is an Enum subclass and is now
natively supported by torch.compile ... Calling register_constant() on Enum subclasses is deprecated" once per
enum that a library registers. torchao 0.18 registers two of its enums (``KernelPreference``,
``ScaleCalculationMode``) when it is imported, and transformers imports it (``transformers.quantizers`` ->
``torchao.prototype.safetensors``) as soon as ``Trainer`` or a model class is imported: every notebook, and
``macroarch.integrations``, would print both lines on stderr. Only records about an enum defined in torchao are
dropped; the same message about any other enum (the user's own code) still shows, and nothing else from that
logger is touched. Installing the filter imports neither torch nor torchao.

transformers' "`loss_type=None` was set in the config but it is unrecognized" (GPT-2's model class has no loss type
in its name) is not filtered: for a user's own model it can matter. For the GPT-2 models macroarch builds, the fix
belongs where they are built (``ModelSpec.build`` setting ``model.loss_type = "ForCausalLM"``).
"""

from __future__ import annotations

import logging

_PYTREE_LOGGER = "torch.utils._pytree"
_ENUM_CONSTANT = "is an Enum subclass and is now natively supported by torch.compile"


class _TorchaoEnumConstants(logging.Filter):
    """Drops torch's deprecation record for ``register_constant`` on an Enum when the enum is torchao's."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _ENUM_CONSTANT not in str(record.msg) or not isinstance(record.args, tuple) or not record.args:
            return True
        module = getattr(record.args[0], "__module__", "") or ""
        return module.split(".")[0] != "torchao"


def install() -> None:
    """Add the filters above, once (idempotent: importing macroarch again adds nothing)."""
    logger = logging.getLogger(_PYTREE_LOGGER)
    if not any(isinstance(f, _TorchaoEnumConstants) for f in logger.filters):
        logger.addFilter(_TorchaoEnumConstants())
