"""The manifest a trainer describes its tensors with (weight_transfer): every entry's fields checked
with a message naming the entry and the field, the boundaries of sizes and offsets, and the
shared-memory reader's views of a region written here byte by byte with numpy."""

from __future__ import annotations

import warnings
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

from triton_sampling_mask.generation.weight_transfer import (
    SharedMemoryTensors,
    _entries,
    manifest_entry,
    manifest_of,
)
from triton_sampling_mask.generation.weights import WeightUpdateError

DTYPE_NAMES = "['bfloat16', 'float16', 'float32', 'float64', 'int32', 'int64', 'int8']"


def refused(call, *args, **kwargs) -> str:
    """The message of the WeightUpdateError that `call(*args)` raises."""
    with pytest.raises(WeightUpdateError) as caught:
        call(*args, **kwargs)
    assert str(caught.value) == caught.value.message
    return caught.value.message


def entry(**fields) -> dict:
    return {"name": "w", "dtype": "float32", "shape": [2, 3], **fields}


# manifest_entry: one entry, checked field by field.


def test_an_entry_is_read_as_name_dtype_shape_and_offset():
    assert manifest_entry(entry(offset=64), 0, True) == ("w", torch.float32, (2, 3), 64)
    assert manifest_entry({"name": "b", "dtype": "bfloat16", "shape": []}, 5, False) == ("b", torch.bfloat16, (), 0)


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("float64", torch.float64),
        ("float32", torch.float32),
        ("float16", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("int64", torch.int64),
        ("int32", torch.int32),
        ("int8", torch.int8),
    ],
)
def test_each_dtype_name_is_torchs(name, dtype):
    assert manifest_entry(entry(dtype=name), 0, False)[1] is dtype


def test_an_entry_without_an_offset_starts_at_byte_0():
    assert manifest_entry(entry(), 0, True)[3] == 0
    assert manifest_entry(entry(), 0, False)[3] == 0


def test_sizes_and_offsets_of_zero_are_accepted():
    assert manifest_entry(entry(shape=[0, 3], offset=0), 2, True) == ("w", torch.float32, (0, 3), 0)
    assert manifest_entry(entry(shape=[0]), 0, False)[2] == (0,)


@pytest.mark.parametrize("bad", [["w"], "w", 7, None])
def test_an_entry_that_is_not_an_object_is_refused_naming_its_index(bad):
    assert refused(manifest_entry, bad, 3, True) == "tensors[3] must be an object with a string 'name'"


@pytest.mark.parametrize("name", [5, None, b"w"])
def test_an_entry_without_a_string_name_is_refused(name):
    bad = {"name": name, "dtype": "float32", "shape": [1]}
    assert refused(manifest_entry, bad, 1, False) == "tensors[1] must be an object with a string 'name'"
    assert refused(manifest_entry, {"dtype": "float32", "shape": [1]}, 0, False) == (
        "tensors[0] must be an object with a string 'name'"
    )


@pytest.mark.parametrize("dtype", ["float8", "torch.float32", None, "uint8"])
def test_an_unknown_dtype_is_refused_listing_the_known_ones(dtype):
    assert refused(manifest_entry, entry(dtype=dtype), 4, True) == (
        f"tensors[4] ('w'): dtype must be one of {DTYPE_NAMES}, got {dtype!r}"
    )


def test_a_missing_dtype_is_refused_as_none():
    bad = {"name": "w", "shape": [1]}
    assert refused(manifest_entry, bad, 0, False) == f"tensors[0] ('w'): dtype must be one of {DTYPE_NAMES}, got None"


@pytest.mark.parametrize("shape", [(2, 3), [2, -1], [-1], ["2"], [2.0], None, "23", {"0": 2}, [True, 3], [False]])
def test_a_shape_not_a_list_of_sizes_is_refused(shape):
    assert refused(manifest_entry, entry(shape=shape), 2, False) == (
        "tensors[2] ('w'): shape must be a list of sizes >= 0"
    )


@pytest.mark.parametrize("offset", [-1, -64, "8", 8.0, None, True, False])
def test_a_bad_offset_is_refused_where_offsets_are_read(offset):
    assert refused(manifest_entry, entry(offset=offset), 0, True) == (
        "tensors[0] ('w'): offset must be an integer >= 0"
    )


@pytest.mark.parametrize("offset", [-8, 8, "x", None, 8.5, [1], True])
def test_offsets_are_ignored_where_they_are_not_read(offset):
    assert manifest_entry(entry(offset=offset), 0, False) == ("w", torch.float32, (2, 3), 0)


# _entries: the whole manifest.


@pytest.mark.parametrize("manifest", [[], {}, {"w": entry()}, "tensors", None, (entry(),)])
def test_a_manifest_not_a_non_empty_list_is_refused(manifest):
    assert refused(_entries, manifest, True) == "tensors must be a non-empty list of {name, dtype, shape} objects"


def test_entries_are_read_in_order_and_named_by_their_index():
    manifest = [entry(name="a", offset=0), entry(name="b", offset=32), entry(name="c", shape=[4], offset=64)]
    assert _entries(manifest, True) == [
        ("a", torch.float32, (2, 3), 0),
        ("b", torch.float32, (2, 3), 32),
        ("c", torch.float32, (4,), 64),
    ]
    assert refused(_entries, [entry(name="a"), entry(name="b", dtype="f32")], False) == (
        f"tensors[1] ('b'): dtype must be one of {DTYPE_NAMES}, got 'f32'"
    )


def test_the_offsets_are_checked_only_when_asked():
    manifest = [entry(name="a", offset=0), entry(name="b", offset=-4)]
    assert refused(_entries, manifest, True) == "tensors[1] ('b'): offset must be an integer >= 0"
    assert [e[0] for e in _entries(manifest, False)] == ["a", "b"]


def test_a_name_given_twice_is_refused():
    manifest = [entry(name="a"), entry(name="b", dtype="int8"), entry(name="a", dtype="int64")]
    assert refused(_entries, manifest, False) == "tensors names a tensor twice"


# manifest_of: what a trainer sends, read back by manifest_entry.


def test_the_manifest_of_tensors_names_dtype_and_shape_in_order():
    tensors = {
        "b.weight": torch.zeros(2, 3, dtype=torch.bfloat16),
        "a.bias": torch.zeros(5, dtype=torch.float64),
        "scalar": torch.tensor(3, dtype=torch.int8),
        "empty": torch.zeros(0, 4, dtype=torch.int32),
    }
    manifest = manifest_of(tensors)
    assert manifest == [
        {"name": "b.weight", "dtype": "bfloat16", "shape": [2, 3]},
        {"name": "a.bias", "dtype": "float64", "shape": [5]},
        {"name": "scalar", "dtype": "int8", "shape": []},
        {"name": "empty", "dtype": "int32", "shape": [0, 4]},
    ]
    assert all(type(e["shape"]) is list for e in manifest)
    assert _entries(manifest, False) == [
        ("b.weight", torch.bfloat16, (2, 3), 0),
        ("a.bias", torch.float64, (5,), 0),
        ("scalar", torch.int8, (), 0),
        ("empty", torch.int32, (0, 4), 0),
    ]


# SharedMemoryTensors: a region written here with numpy, read through the manifest.

REGION_BYTES = 64
FLOATS = np.arange(6, dtype=np.float32).reshape(2, 3) * 0.5 - 1.0  # bytes 8..32
LONGS = np.array([-3, 2**40 + 7], dtype=np.int64)  # bytes 32..48
BYTES = np.array([-128, 0, 127], dtype=np.int8)  # bytes 48..51


@pytest.fixture
def region():
    shm = shared_memory.SharedMemory(create=True, size=REGION_BYTES)
    try:
        view = np.ndarray((REGION_BYTES,), np.uint8, shm.buf)
        view[:] = 0xAB
        view[8:32] = FLOATS.reshape(-1).view(np.uint8)
        view[32:48] = LONGS.view(np.uint8)
        view[48:51] = BYTES.view(np.uint8)
        del view
        yield shm.name.lstrip("/")
    finally:
        shm.close()
        shm.unlink()


MANIFEST = [
    {"name": "floats", "dtype": "float32", "shape": [2, 3], "offset": 8},
    {"name": "longs", "dtype": "int64", "shape": [2], "offset": 32},
    {"name": "bytes", "dtype": "int8", "shape": [3], "offset": 48},
    {"name": "empty", "dtype": "int64", "shape": [0, 3], "offset": 64},
]


def test_a_region_is_read_at_each_entrys_offset(region):
    with SharedMemoryTensors(region, MANIFEST) as mapped:
        assert list(mapped.tensors) == ["floats", "longs", "bytes", "empty"]
        floats, longs, small, empty = (mapped.tensors[e["name"]] for e in MANIFEST)
        assert floats.dtype == torch.float32 and floats.shape == (2, 3)
        assert np.array_equal(floats.numpy(), FLOATS)
        assert longs.dtype == torch.int64 and longs.tolist() == [-3, 2**40 + 7]
        assert small.dtype == torch.int8 and small.tolist() == [-128, 0, 127]
        assert empty.dtype == torch.int64 and empty.shape == (0, 3)
        source = mapped.source()
        assert source.label == f"shared-memory region {region!r}" == mapped.label
        assert source.complete is False
        assert {name: (info.shape, info.dtype) for name, info in source.infos().items()} == {
            "floats": ((2, 3), torch.float32),
            "longs": ((2,), torch.int64),
            "bytes": ((3,), torch.int8),
            "empty": ((0, 3), torch.int64),
        }
        assert [(rows, values.tolist()) for rows, values in source.pieces("longs")] == [(None, [-3, 2**40 + 7])]
    assert mapped.tensors == {}


def test_a_zero_size_tensor_may_sit_at_the_regions_end(region):
    manifest = [{"name": "z", "dtype": "bfloat16", "shape": [4, 0], "offset": REGION_BYTES}]
    with SharedMemoryTensors(region, manifest) as mapped:
        assert mapped.tensors["z"].dtype == torch.bfloat16 and mapped.tensors["z"].shape == (4, 0)


def test_a_tensor_may_end_at_the_regions_last_byte(region):
    manifest = [{"name": "tail", "dtype": "int8", "shape": [13], "offset": REGION_BYTES - 13}]
    with SharedMemoryTensors(region, manifest) as mapped:
        assert mapped.tensors["tail"].tolist() == [0xAB - 256] * 13  # the filler bytes past BYTES


@pytest.mark.parametrize(
    "shape, offset, end",
    [([15], 8, 68), ([2, 3], 48, 72), ([1], 64, 68), ([17], 0, 68)],
)
def test_a_tensor_past_the_regions_end_is_refused_naming_the_byte(region, shape, offset, end):
    manifest = [MANIFEST[0], {"name": "over", "dtype": "float32", "shape": shape, "offset": offset}]
    assert refused(SharedMemoryTensors, region, manifest) == (
        f"shared-memory region {region!r}: tensor 'over' ends at byte {end}, past the region's end"
    )


def test_a_negative_offset_is_refused_before_the_region_is_read(region):
    manifest = [MANIFEST[0], {"name": "back", "dtype": "int8", "shape": [1], "offset": -1}]
    assert refused(SharedMemoryTensors, region, manifest) == "tensors[1] ('back'): offset must be an integer >= 0"


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b", "", ".hidden", "x" * 202, 7, None])
def test_a_region_name_with_a_path_is_refused(name):
    assert refused(SharedMemoryTensors, name, MANIFEST) == (
        "shm_name must be a shared-memory region name (letters, digits, _.-; no path)"
    )


def test_a_missing_region_is_refused_naming_it():
    assert refused(SharedMemoryTensors, "no_such_region_for_this_test", MANIFEST) == (
        "shared-memory region 'no_such_region_for_this_test' cannot be opened (FileNotFoundError)"
    )


def test_a_bad_manifest_is_refused_before_the_region_is_opened():
    assert refused(SharedMemoryTensors, "no_such_region_for_this_test", []) == (
        "tensors must be a non-empty list of {name, dtype, shape} objects"
    )


def test_reading_a_region_warns_nothing_even_where_warnings_are_errors(region):
    # torch warns about a read-only buffer once per process unless told to warn always.
    always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with SharedMemoryTensors(region, MANIFEST[:2]) as mapped:
                assert mapped.tensors["longs"].tolist() == [-3, 2**40 + 7]
    finally:
        torch.set_warn_always(always)
