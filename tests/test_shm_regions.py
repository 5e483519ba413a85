"""How the supervisor finds dead stubs' /dev/shm regions (ops/shm_cleanup.py), on this process's own
mappings: a region's size is its largest mapping, an unlinked one is counted as leaked while it is
mapped, and a region no current stub names is unlinked at the second sweep that finds it, not the first."""

from __future__ import annotations

import mmap
import os

import pytest

from triton_sampling_mask.ops.shm_cleanup import SHM_DIR, DeadStubRegions, leaked_regions, mapped_regions


@pytest.fixture
def region():
    prefix = f"tsm_regions_test_{os.getpid()}_"
    path = SHM_DIR / (prefix + "a")
    path.write_bytes(b"\0" * 8192)
    with open(path, "r+b") as handle:
        small, large = mmap.mmap(handle.fileno(), 4096), mmap.mmap(handle.fileno(), 8192)  # a region that grew
        try:
            yield prefix, path
        finally:
            small.close()
            large.close()
            path.unlink(missing_ok=True)


def test_a_mapped_region_is_measured_by_its_largest_mapping_and_leaks_once_unlinked(region):
    prefix, path = region
    (found,) = mapped_regions(os.getpid(), prefix).values()
    assert (found.name, found.size, found.deleted) == (path.name, 8192, False)
    assert leaked_regions(os.getpid(), prefix) == (0, 0)
    path.unlink()
    assert leaked_regions(os.getpid(), prefix) == (1, 8192)
    assert mapped_regions(os.getpid(), "tsm_no_such_prefix_") == {}


def test_an_orphaned_region_is_unlinked_at_the_second_sweep(region):
    prefix, path = region
    sweeper = DeadStubRegions(prefix)
    assert sweeper.sweep(os.getpid(), stub_pids=[]) == [] and path.exists()  # maybe a stub about to start
    assert sweeper.sweep(os.getpid(), stub_pids=[]) == [path.name] and not path.exists()
    assert leaked_regions(os.getpid(), prefix) == (1, 8192)
    with pytest.raises(ValueError):
        DeadStubRegions("")
