"""Objects attached to a prepared CPU weight for the weight's life, found again from one of its
tensors: compiled layers take the weights' tensors as inputs and pass them to custom ops, which
see tensors, not the weight, so the attachment is kept off the weight, keyed by the tensor's
data pointer, and dropped when the weight goes."""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


class Attachments(Generic[T]):
    """One kind of attachment (a weight's GEMM template, its dequantised copy, ...)."""

    def __init__(self) -> None:
        # key tensor's data_ptr → (the weight, weakly; the attached object)
        self._by_ptr: dict[int, tuple[weakref.ref, T]] = {}

    def attach(self, w: Any, key: torch.Tensor, value: T) -> None:
        """Attach `value` to `w` (which holds `key`) for `w`'s life."""
        ptr = key.data_ptr()
        by_ptr = self._by_ptr

        def forget(ref: weakref.ref, ptr: int = ptr) -> None:
            if ptr in by_ptr and by_ptr[ptr][0] is ref:
                del by_ptr[ptr]

        by_ptr[ptr] = (weakref.ref(w, forget), value)

    def lookup(self, key: torch.Tensor) -> T | None:
        """What is attached to the weight whose tensor `key` is, if anything."""
        entry = self._by_ptr.get(key.data_ptr())
        return entry[1] if entry is not None and entry[0]() is not None else None
