"""engine/sinks/_host.py: owned host blocks, their huge-page advice and the rule for it."""

from __future__ import annotations

import os

import pytest

from engine.sinks import _host


def _vm_flags(block) -> str:
    """The ``VmFlags`` line of the mapping that holds ``block`` (from /proc/self/smaps)."""
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(block))
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = lo <= addr < hi
            elif line.startswith("VmFlags") and current:
                return line
    raise AssertionError("block not found in smaps")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
@pytest.mark.parametrize("huge", ["1", "0"])
def test_a_large_block_asks_for_huge_pages_unless_told_not_to(monkeypatch, huge):
    monkeypatch.setenv("ENGINE_HUGE_PAGES", huge)
    block = _host.host_block(8 << 20)
    small = _host.host_block(64 << 10)
    try:
        assert (" hg" in _vm_flags(block)) == (huge == "1")
        assert " hg" not in _vm_flags(small)  # below HUGE_BLOCK_BYTES: never
        assert len(block) == 8 << 20 and block[:16] == bytes(16)
    finally:
        block.close()
        small.close()


def _sysfs(tmp_path, order: str | None, features: list[str]) -> str:
    root = tmp_path / "sys"
    if order is not None:
        p = root / "module/page_reporting/parameters"
        p.mkdir(parents=True)
        (p / "page_reporting_order").write_text(order + "\n")
    for i, bits in enumerate(features):
        d = root / f"bus/virtio/drivers/virtio_balloon/virtio{i}"
        d.mkdir(parents=True)
        (d / "features").write_text(bits + "\n")
    return str(root)


@pytest.mark.parametrize(
    ("order", "features", "reported"),
    [
        ("9", ["0110010100000000"], True),  # this workplace's VM: a balloon that reports 2 MiB blocks
        ("9", ["0110000100000000"], False),  # a balloon without free page reporting
        ("10", ["0110010100000000"], False),  # reports only blocks larger than a huge page
        ("9", [], False),  # no balloon bound
        (None, ["0110010100000000"], False),  # a kernel without page reporting
        ("x", ["0110010100000000"], False),
        ("9", ["0000", "000001"], True),  # the second of two balloons
    ],
)
def test_free_page_reporting_is_read_from_sysfs(tmp_path, order, features, reported):
    assert _host.free_pages_reported.__wrapped__(_sysfs(tmp_path, order, features)) is reported


def test_huge_pages_follow_the_environment_then_the_machine(monkeypatch):
    monkeypatch.setattr(_host, "free_pages_reported", lambda: True)
    monkeypatch.delenv("ENGINE_HUGE_PAGES", raising=False)
    assert _host.huge_pages() is False
    monkeypatch.setenv("ENGINE_HUGE_PAGES", "1")
    assert _host.huge_pages() is True
    monkeypatch.setattr(_host, "free_pages_reported", lambda: False)
    monkeypatch.delenv("ENGINE_HUGE_PAGES")
    assert _host.huge_pages() is True
    for off in ("0", "off", "No", "false"):
        monkeypatch.setenv("ENGINE_HUGE_PAGES", off)
        assert _host.huge_pages() is False


def test_pack_offsets_keeps_file_neighbours_together_and_aligns_the_rest():
    from engine.base import dtypes

    f32 = dtypes.code_of("F32")
    begins = [0, 12, 100]
    specs = [(0, f32, (3,), 12), (1, f32, (2,), 8), (2, f32, (1,), 4)]
    offsets, total = _host.pack_offsets(specs, begins)
    assert offsets == [0, 12, _host.HOST_ALIGNMENT]  # row 1 follows row 0 in the file; row 2 does not
    assert total == _host.HOST_ALIGNMENT + 4
