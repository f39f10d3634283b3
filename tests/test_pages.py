"""`bertembed.kernels.pages`: telling fresh memory from kept memory, and asking for huge pages without harm."""

import mmap
import sys

import numpy as np
import pytest
import torch

from bertembed.kernels import pages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and madvise are Linux calls here")


def _mapped(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A float32 tensor over a new anonymous mapping (the mapping is returned too, to keep it alive)."""
    region = mmap.mmap(-1, nbytes)
    return region, torch.from_numpy(np.frombuffer(region, dtype=np.float32))


@linux
def test_a_new_mapping_is_fresh_until_written():
    region, t = _mapped(8 << 20)
    assert pages.is_fresh(t)
    t[: mmap.PAGESIZE].fill_(1.0)  # the first pages are in RAM now
    assert not pages.is_fresh(t)
    del t
    region.close()


def test_kept_and_tiny_memory_is_not_fresh():
    assert not pages.is_fresh(torch.ones(1 << 20))  # written: in RAM
    assert not pages.is_fresh(torch.empty(3))  # no whole page inside


@linux
def test_huge_page_advice_keeps_the_memory_as_it_was():
    region, t = _mapped(8 << 20)
    pages.advise_huge_pages(t)
    assert t.abs().max().item() == 0.0  # a new mapping reads as zeros, advised or not
    t[100:200] = 2.0
    pages.advise_huge_pages(t)  # advising written memory changes no value
    assert t.sum().item() == 200.0
    pages.advise_huge_pages(torch.empty(3))  # under 2 MB: nothing to advise, no error
    del t
    region.close()


@linux
def test_advise_if_fresh_only_for_large_fresh_memory():
    region, t = _mapped(8 << 20)
    assert pages.advise_if_fresh(t)
    assert not pages.advise_if_fresh(t[: 1 << 18])  # 1 MB: under the size worth advising
    del t
    region.close()
    assert not pages.advise_if_fresh(torch.ones(2 << 20))  # 8 MB, written


@linux
def test_only_large_outputs_in_kept_memory_are_streamed(monkeypatch):
    """The CPU forward streams its output (non-temporal stores) only where that was measured to pay: float32 and
    bfloat16, from `_STREAM_OUT_FROM` bytes, and not into fresh memory, whose pages fault in at their first write."""
    from bertembed.kernels import cpu_run

    region, t = _mapped(8 << 20)
    monkeypatch.setattr(cpu_run, "_STREAM_OUT_FROM", 4 << 20)
    assert not cpu_run.stream_output(t)  # fresh, found by asking
    t.fill_(1.0)
    assert cpu_run.stream_output(t)
    assert not cpu_run.stream_output(t, fresh=True)  # as run_forward saw it when it allocated
    assert cpu_run.stream_output(t.view(torch.bfloat16))
    assert not cpu_run.stream_output(t.view(torch.int32))
    assert not cpu_run.stream_output(t[: 1 << 19])  # 2 MB
    del t
    region.close()


def test_outputs_stream_from_12_mib_on_zen_cores_and_32_elsewhere():
    from bertembed.kernels import cpu_rows, cpu_run

    assert cpu_run._stream_out_from("znver3") == cpu_run._stream_out_from("znver4") == 12 << 20
    assert cpu_run._stream_out_from("sapphirerapids") == cpu_run._stream_out_from("generic") == 32 << 20
    assert cpu_run._STREAM_OUT_FROM == cpu_run._stream_out_from(cpu_rows.CPU_NAME)


@linux
def test_tables_are_collapsed_once_and_keep_their_values(monkeypatch):
    monkeypatch.setattr(pages, "_COLLAPSE_FROM", 4 << 20)
    monkeypatch.setattr(pages, "_collapsed", set())
    table = torch.arange(4 << 20, dtype=torch.float32)  # 16 MB, private memory as torch allocates it
    before = table.clone()
    assert pages.collapse_table(table.data_ptr(), table.nbytes)
    assert not pages.collapse_table(table.data_ptr(), table.nbytes)  # asked once per table
    assert torch.equal(table, before)
    assert not pages.collapse_table(table.data_ptr() + 4, 1 << 20)  # under the size worth it
    other = torch.arange(2 << 20, dtype=torch.float32)
    monkeypatch.setenv("BERTEMBED_COLLAPSE_TABLES", "0")
    assert not pages.collapse_table(other.data_ptr(), other.nbytes)


def _thp_mode() -> str:
    """The kernel's transparent huge page mode: always, madvise or never ("" where it cannot be read)."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def _huge_kb(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings over `t`'s memory, from /proc/self/smaps (kB; advice splits a mapping)."""
    start, stop, inside, total = t.data_ptr(), t.data_ptr() + t.nbytes, False, 0
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < stop and start < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


@linux
@pytest.mark.skipif(_thp_mode() != "madvise", reason="huge pages follow the advice only in THP's madvise mode")
@pytest.mark.parametrize("huge", [True, False])
def test_huge_pages_follow_the_switch_and_fresh_memory_is_still_told_apart(huge, monkeypatch):
    """BERTEMBED_HUGE_PAGES=0 (here its cached answer) keeps fresh memory on 4 KB pages, and `advise_if_fresh` still
    says it was fresh, which decides how the kernels write it."""
    monkeypatch.setattr(pages, "_advice", [huge])
    region = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as malloc maps large blocks
    t = torch.from_numpy(np.frombuffer(region, dtype=np.float32))
    assert pages.advise_if_fresh(t)
    t.fill_(1.0)  # the pages fault in now, 2 MB ones where advised
    assert (_huge_kb(t) > 0) == huge
    del t
    region.close()


@pytest.mark.parametrize(("value", "huge"), [(None, True), ("1", True), ("0", False)])
def test_the_huge_page_switch_is_read_from_the_environment(value, huge, monkeypatch):
    monkeypatch.setattr(pages, "_advice", [])
    if value is None:
        monkeypatch.delenv("BERTEMBED_HUGE_PAGES", raising=False)
    else:
        monkeypatch.setenv("BERTEMBED_HUGE_PAGES", value)
    assert pages.huge_pages() is huge
    monkeypatch.setenv("BERTEMBED_HUGE_PAGES", "1" if value == "0" else "0")
    assert pages.huge_pages() is huge  # read once, at the first large output or gradient
