"""Slot ranges of the switch's register memory: first fit over [0, slots)."""

from __future__ import annotations


class SlotsExhausted(RuntimeError):
    """No free range is large enough."""


class SlotAllocator:
    def __init__(self, slots: int) -> None:
        if slots < 0:
            raise ValueError("slots must be >= 0")  # 0: a topology without a switch
        self.slots = slots
        self.used: dict[int, int] = {}  # base -> pool

    def reserve(self, base: int, pool: int) -> None:
        """Mark a range used (an allocation restored from the store)."""
        if base < 0 or pool < 1 or base + pool > self.slots:
            raise ValueError(f"range {base}+{pool} outside 0..{self.slots - 1}")
        for b, p in self.used.items():
            if base < b + p and b < base + pool:
                raise ValueError(f"range {base}+{pool} overlaps {b}+{p}")
        self.used[base] = pool

    def allocate(self, pool: int) -> int:
        if pool < 1:
            raise ValueError("pool must be >= 1")
        at = 0
        for b in sorted(self.used):
            if b - at >= pool:
                break
            at = max(at, b + self.used[b])
        if at + pool > self.slots:
            raise SlotsExhausted(f"no free range of {pool} slots ({self.free()} of {self.slots} free)")
        self.used[at] = pool
        return at

    def release(self, base: int) -> None:
        self.used.pop(base, None)

    def free(self) -> int:
        return self.slots - sum(self.used.values())

    def free_ranges(self) -> list[tuple[int, int]]:
        out, at = [], 0
        for b in sorted(self.used):
            if b > at:
                out.append((at, b - at))
            at = max(at, b + self.used[b])
        if at < self.slots:
            out.append((at, self.slots - at))
        return out
