"""A step's model inputs from the runner's per-slot arrays, and its sampled tokens written back: the C++
(worker_svc/csrc/step_inputs.cpp) and numpy implementations give the same values, and refuse a slot or
position outside the arrays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.worker_svc.step_inputs import SlotArrays, StepInputs, native_step_inputs

CPU = torch.device("cpu")
IMPLEMENTATIONS = [
    pytest.param(False, id="numpy"),
    pytest.param(
        True,
        id="c++",
        marks=pytest.mark.skipif(
            native_step_inputs() is None, reason="the C++ step inputs cannot be built here"
        ),
    ),
]


def arrays(native: bool, token_ids: np.ndarray, block_tables: np.ndarray, block_size: int) -> SlotArrays:
    result = SlotArrays(max_model_len=64, block_size=block_size, device=CPU, native=native)
    result.token_ids, result.block_tables = token_ids, block_tables
    return result


def fields(inputs: StepInputs) -> list[torch.Tensor]:
    attn = inputs.attn
    return [
        inputs.input_ids,
        inputs.positions,
        attn.slot_mapping,
        attn.block_tables,
        attn.query_start_loc,
        attn.context_lens,
    ]


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
def test_decode_inputs_gather_each_sequences_token_slot_and_table(native):
    token_ids = np.arange(40, dtype=np.int64).reshape(4, 10)
    tables = np.array([[7, 3, 9], [2, 0, 0], [5, 6, 0], [1, 4, 8]], dtype=np.int32)
    inputs = arrays(native, token_ids, tables, 4).inputs([3, 1, 2], [9, 2, 4], None)
    ids, positions, slot_mapping, block_tables, query_start_loc, context_lens = fields(inputs)
    assert ids.tolist() == [39, 12, 24] and positions.tolist() == [9, 2, 4]
    assert slot_mapping.tolist() == [8 * 4 + 1, 2 * 4 + 2, 6 * 4 + 0]
    assert block_tables.tolist() == [[1, 4, 8], [2, 0, 0], [5, 6, 0]]  # the longest sequence's 3 blocks
    assert query_start_loc.tolist() == [0, 1, 2, 3] and context_lens.tolist() == [10, 3, 5]
    longs, ints = (ids, positions, slot_mapping), (block_tables, query_start_loc, context_lens)
    assert all(t.dtype == torch.int64 for t in longs) and all(t.dtype == torch.int32 for t in ints)
    assert inputs.attn.max_query_len == 1


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
def test_chunk_inputs_cover_every_scheduled_position_in_plan_order(native):
    token_ids = np.arange(60, dtype=np.int64).reshape(3, 20)
    tables = np.array([[7, 3, 9, 2], [2, 5, 0, 0], [5, 6, 1, 0]], dtype=np.int32)
    # slot 2 computes positions 3..8 (a chunk over 3 cached tokens), slot 0 one decode token, slot 1 a prompt
    inputs = arrays(native, token_ids, tables, 4).inputs([2, 0, 1], [3, 13, 0], [6, 1, 5])
    ids, positions, slot_mapping, block_tables, query_start_loc, context_lens = fields(inputs)
    assert positions.tolist() == [3, 4, 5, 6, 7, 8, 13, 0, 1, 2, 3, 4]
    assert ids.tolist() == [43, 44, 45, 46, 47, 48, 13, 20, 21, 22, 23, 24]
    assert slot_mapping.tolist() == [23, 24, 25, 26, 27, 4, 9, 8, 9, 10, 11, 20]
    assert block_tables.tolist() == [[5, 6, 1, 0], [7, 3, 9, 2], [2, 5, 0, 0]]
    assert query_start_loc.tolist() == [0, 6, 7, 12] and context_lens.tolist() == [9, 14, 5]
    assert inputs.attn.max_query_len == 6


def test_the_cpp_gives_numpys_inputs_on_random_steps():
    if native_step_inputs() is None:
        pytest.skip("the C++ step inputs cannot be built here")
    gen = np.random.default_rng(0)
    for block_size in (1, 4, 16):
        token_ids = gen.integers(0, 1000, (9, 70), dtype=np.int64)
        tables = gen.integers(0, 500, (9, -(-70 // block_size)), dtype=np.int32)
        for _ in range(20):
            n = int(gen.integers(1, 9))
            slots = gen.permutation(9)[:n].tolist()
            counts = gen.integers(1, 12, n).tolist()
            start = [int(gen.integers(0, 70 - c + 1)) for c in counts]
            for scheduled in (counts, None):
                want = arrays(False, token_ids, tables, block_size).inputs(slots, start, scheduled)
                got = arrays(True, token_ids, tables, block_size).inputs(slots, start, scheduled)
                for g, w in zip(fields(got), fields(want), strict=True):
                    assert g.dtype == w.dtype and torch.equal(g, w)
                assert got.attn.max_query_len == want.attn.max_query_len


def test_the_cpp_refuses_a_slot_or_position_outside_the_arrays():
    # (numpy raises its own IndexError there; the runner's validation keeps plans inside the arrays)
    if native_step_inputs() is None:
        pytest.skip("the C++ step inputs cannot be built here")
    native = True
    token_ids, tables = np.zeros((4, 8), dtype=np.int64), np.zeros((4, 2), dtype=np.int32)
    with pytest.raises(RuntimeError, match="slot 4 is outside the arrays"):
        arrays(native, token_ids, tables, 4).inputs([4], [0], None)
    with pytest.raises(RuntimeError, match="position 8 of slot 1 is outside the arrays"):
        arrays(native, token_ids, tables, 4).inputs([1], [8], None)
    with pytest.raises(RuntimeError, match="position 7 of slot 1 is outside the arrays"):  # past its table
        arrays(native, token_ids, tables, 2).inputs([1], [7], None)
    with pytest.raises(RuntimeError, match="position 8 of slot 1 is outside the arrays"):  # a chunk past it
        arrays(native, token_ids, tables, 4).inputs([1], [5], [4])


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
def test_append_writes_each_token_at_its_slots_position(native):
    slot_arrays = arrays(native, np.full((5, 6), -1, dtype=np.int64), np.zeros((5, 2), dtype=np.int32), 4)
    tokens = slot_arrays.append([4, 0, 2], [5, 0, 3], torch.tensor([7, 8, 9]))
    assert tokens == [7, 8, 9]
    expected = np.full((5, 6), -1, dtype=np.int64)
    expected[4, 5], expected[0, 0], expected[2, 3] = 7, 8, 9
    assert np.array_equal(slot_arrays.token_ids, expected)
    # A position past the rows grows them (by doubling) and keeps what they held.
    assert slot_arrays.append([1], [6], torch.tensor([5])) == [5]
    assert slot_arrays.token_ids.shape == (5, 12) and slot_arrays.token_ids[1, 6] == 5
    assert np.array_equal(slot_arrays.token_ids[:, :6], expected)


def test_append_refuses_a_place_outside_the_token_ids_and_writes_nothing():
    if native_step_inputs() is None:
        pytest.skip("the C++ step inputs cannot be built here")
    slot_arrays = arrays(True, np.zeros((3, 4), dtype=np.int64), np.zeros((3, 1), dtype=np.int32), 4)
    for slots, positions, message in [
        ([0, 3], [1, 1], "position 1 of slot 3 is outside the token ids"),
        ([0, 1], [1, -1], "position -1 of slot 1 is outside the token ids"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            slot_arrays.append(slots, positions, torch.tensor([1, 2]))
    assert not slot_arrays.token_ids.any()


def test_the_build_is_named_after_its_sources_flags_and_folder(tmp_path):
    # Two checkouts (or an edited source) sharing one extension cache must not load each other's build.
    from pagedserve.kernels.build import extension_name

    source = tmp_path / "a" / "ops.cpp"
    source.parent.mkdir()
    source.write_text("int f() { return 1; }\n")
    name = extension_name("pagedserve_test", [source], ["-O3"])
    assert name.startswith("pagedserve_test_") and name == extension_name(
        "pagedserve_test", [source], ["-O3"]
    )
    assert extension_name("pagedserve_test", [source], ["-O2"]) != name
    elsewhere = tmp_path / "b" / "ops.cpp"
    elsewhere.parent.mkdir()
    elsewhere.write_text(source.read_text())
    assert extension_name("pagedserve_test", [elsewhere], ["-O3"]) != name
    source.write_text("int f() { return 2; }\n")
    assert extension_name("pagedserve_test", [source], ["-O3"]) != name
