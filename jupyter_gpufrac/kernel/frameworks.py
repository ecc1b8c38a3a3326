"""Caps for GPU frameworks other than PyTorch that only an API call can set (TensorFlow)."""

from __future__ import annotations

import logging
import types

log = logging.getLogger(__name__)


def cap_tensorflow(tf: types.ModuleType, nbytes: int) -> list[str]:
    """Give every visible GPU one logical device limited to ``nbytes``; the devices capped.

    TensorFlow takes this only before it first uses a GPU, hence right after its import.
    """
    capped = []
    for gpu in tf.config.list_physical_devices("GPU"):
        config = tf.config.LogicalDeviceConfiguration(memory_limit=max(1, nbytes // 2**20))
        try:
            tf.config.set_logical_device_configuration(gpu, [config])
        except (RuntimeError, ValueError) as exc:  # already initialised: say so, keep going
            log.warning("gpufrac: TensorFlow's memory on %s could not be capped: %s", gpu.name, exc)
            continue
        capped.append(str(gpu.name))
    return capped
