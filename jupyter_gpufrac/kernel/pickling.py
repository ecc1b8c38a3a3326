"""The callables a checkpoint's pickles name, under this module's path: old checkpoints still load."""

from __future__ import annotations

import pickle
from typing import Any

# Pickles name these by this module's path (``jupyter_gpufrac.kernel.pickling._tensor_ref``):
# moved or renamed, a checkpoint written before would no longer load.


def _tensor_ref(*args: Any) -> Any:
    """Names a tensor in a pickle; :class:`unpickler.NamespaceUnpickler` resolves it, nothing calls it."""
    raise pickle.UnpicklingError("a gpufrac tensor outside a gpufrac restore")


def _storage_ref(*args: Any) -> Any:
    """Names a bare storage in a pickle (see :func:`_tensor_ref`)."""
    raise pickle.UnpicklingError("a gpufrac storage outside a gpufrac restore")


def _user_ns_ref() -> Any:
    """Names the notebook's namespace in a pickle (see :func:`_tensor_ref`)."""
    raise pickle.UnpicklingError("a gpufrac namespace outside a gpufrac restore")


def _fp(*args: Any) -> Any:
    """The callable of fingerprint tokens: fingerprints are compared, never loaded."""
    raise pickle.UnpicklingError("a gpufrac fingerprint cannot be loaded")


def _module_object_ref(*args: Any) -> Any:
    """Names a module's object in a pickle (see :func:`_tensor_ref`)."""
    raise pickle.UnpicklingError("a gpufrac module object outside a gpufrac restore")
