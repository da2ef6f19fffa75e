"""What identifies a tensor's memory: one rule for the observers that count or follow memory.

A tensor's memory is its storage's address (``data_ptr``): views share it, and a storage freed
and allocated again is new memory. A ``FakeTensor`` (``twinshard.measure.fakeaccel``, ``twinshard
plan``) has no address: its storage sits on ``meta`` while the tensor stands for another device,
so its memory is named by the storage object (``_cdata``) instead. A tensor that is itself on
``meta``, or a storage with no memory (address 0), has none: 0.

Used by the memory probe (``twinshard/measure/probe.py``), the schedule recorder's buffers
(``schedule/buffers.py``) and the stream sanitizer (``standin.py``). The device monitor
(``twinshard/measure/monitor.py``) and the step trace (``plan/trace.py``) key something else, the storage
object they hold alive (``_cdata``, on every device): a storage resized to 0 and back, as FSDP
frees and refills its unsharded parameters, stays one entry there, where its address changes.
``starts`` asks whether one tensor begins where another does (the optimized group's kept blocks).
"""

from __future__ import annotations

import torch


def memory_key(t: torch.Tensor, storage=None) -> int:
    """The key of ``t``'s memory (see the module docstring): its address, a fake storage's
    object, or 0 for no memory. ``storage``: ``t.untyped_storage()`` if the caller has it."""
    storage = t.untyped_storage() if storage is None else storage
    if storage.device.type == "meta":
        return storage._cdata if t.device.type != "meta" else 0
    return storage.data_ptr()


def starts(local: torch.Tensor, block: torch.Tensor) -> bool:
    """Whether ``local`` begins where ``block`` does, in the same memory (compared by storage,
    which works on fake tensors too, where data pointers read 0)."""
    return (
        memory_key(local) == memory_key(block) and local.storage_offset() == block.storage_offset()
    )
