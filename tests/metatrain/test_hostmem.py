"""How byte counts read in messages."""

from metatrain import hostmem


def test_sizes_read_in_the_largest_unit_they_fill():
    """A 20 KiB program past a small memory said "needs 0.0 MiB ... more than the 0.0 MiB available"."""
    assert hostmem.size(3 * 2**30 + 2**29) == "3.5 GiB"
    assert hostmem.size(2**30 - 2**19) == "1,023.5 MiB"
    assert hostmem.size(2**20) == "1.0 MiB"
    assert hostmem.size(20 * 2**10) == "20.0 KiB"
    assert hostmem.size(1023) == "1,023 bytes"
    assert hostmem.size(0) == "0 bytes"
    assert hostmem.size(12_000 * 2**30) == "12,000.0 GiB"
