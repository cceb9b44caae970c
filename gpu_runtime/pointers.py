"""The two handle types the layers pass around: device addresses and loaded kernels, both ints."""

from __future__ import annotations


class DevicePtr(int):
    """A device address; 0 is null. Behaves as an int, prints as hex."""

    __slots__ = ()

    def __new__(cls, value: int = 0) -> DevicePtr:
        value = int(value)
        if not 0 <= value < 1 << 64:
            raise ValueError(f"device pointer out of range: {value}")
        return super().__new__(cls, value)

    def offset(self, nbytes: int) -> DevicePtr:
        """The address ``nbytes`` further on (null stays an error, not a small address)."""
        if not self:
            raise ValueError("offset of a null DevicePtr")
        return DevicePtr(int(self) + nbytes)

    def __repr__(self) -> str:
        return f"DevicePtr(0x{int(self):x})"


class KernelHandle(int):
    """A loaded kernel; 0 means "not loaded" (``try_kernel`` on a missing kernel)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"KernelHandle(0x{int(self):x})"
