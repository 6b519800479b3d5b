"""Third-party noise that macroarch's own imports and first compile trigger and a user cannot act on, filtered by
source and message.

- torch's pytree logger (``torch.utils._pytree``) warns "<enum ...> is an Enum subclass and is now natively
  supported by torch.compile ... Calling register_constant() on Enum subclasses is deprecated" once per enum that a
  library registers. torchao 0.18 registers two of its enums (``KernelPreference``, ``ScaleCalculationMode``) when
  it is imported, and transformers imports it (``transformers.quantizers`` -> ``torchao.prototype.safetensors``)
  as soon as ``Trainer`` or a model class is imported: every notebook, and ``macroarch.integrations``, would print
  both lines on stderr. Only records about an enum defined in torchao are dropped; the same message about any
  other enum (the user's own code) still shows.
- torch's C++-extension logger (``torch.utils.cpp_extension``) warns "No CUDA runtime is found, using
  CUDA_HOME='...'" when Inductor imports it, which the first ``torch.compile`` of an MVAS kernel does: on a machine
  with a CUDA toolkit but no usable GPU, every notebook's first MVAS step printed it (in JupyterLab, a pink stderr
  box) although the kernels compiled are CPU code. Only that record is dropped; a user who meant to use a GPU learns
  so from ``torch.cuda.is_available()`` and the device errors, not from this line.

Nothing else from either logger is touched. Installing the filters imports neither torch nor torchao.

transformers' "`loss_type=None` was set in the config but it is unrecognized" (GPT-2's model class has no loss type
in its name) is not filtered: for a user's own model it can matter. For the GPT-2 models macroarch builds, the fix
belongs where they are built (``ModelSpec.build`` setting ``model.loss_type = "ForCausalLM"``).
"""

from __future__ import annotations

import logging

_PYTREE_LOGGER = "torch.utils._pytree"
_ENUM_CONSTANT = "is an Enum subclass and is now natively supported by torch.compile"
_CPP_EXTENSION_LOGGER = "torch.utils.cpp_extension"
_NO_CUDA_RUNTIME = "No CUDA runtime is found, using CUDA_HOME="


class _TorchaoEnumConstants(logging.Filter):
    """Drops torch's deprecation record for ``register_constant`` on an Enum when the enum is torchao's."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _ENUM_CONSTANT not in str(record.msg) or not isinstance(record.args, tuple) or not record.args:
            return True
        module = getattr(record.args[0], "__module__", "") or ""
        return module.split(".")[0] != "torchao"


class _NoCudaRuntime(logging.Filter):
    """Drops torch's "No CUDA runtime is found, using CUDA_HOME=..." record (module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NO_CUDA_RUNTIME)


def install() -> None:
    """Add the filters above, once each (idempotent: importing macroarch again adds nothing)."""
    for name, kind in ((_PYTREE_LOGGER, _TorchaoEnumConstants), (_CPP_EXTENSION_LOGGER, _NoCudaRuntime)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
