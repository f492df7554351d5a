"""gateway.slot_plan: the -np and per-slot context a worker starts with (no I/O)."""

from __future__ import annotations

from gateway.slot_plan import args_override, launch_slots, slot_context


def test_slot_context_is_capped_at_the_training_context_when_known():
    assert slot_context(8192, 4096) == 4096
    assert slot_context(2048, 4096) == 2048
    assert slot_context(8192, 0) == 8192  # training context unknown: not capped


def test_launch_without_flags_in_args_caps_the_plan():
    assert launch_slots([], 2, 1024, 512) == (2, 512, 1024)
    assert launch_slots(["-t", "2"], 4, 2048, 4096) == (4, 2048, 2048)


def test_np_alone_in_args_splits_the_plans_total_and_caps_each_share():
    """2 × 8192 over -np 3 is 5,461 per slot; a 4,096-trained model gets 3 × 4,096: with -c
    16384, 27 % of the KV cache was allocated and never used (a fresh tester's find)."""
    assert launch_slots(["-np", "3"], 2, 8192, 4096) == (3, 4096, 5461)
    assert launch_slots(["--parallel", "1", "-np", "4"], 2, 1024, 4096) == (4, 512, 512)


def test_c_in_args_leaves_the_total_to_the_operator():
    assert launch_slots(["-c", "16384"], 2, 8192, 4096) == (2, 8192, 8192)
    assert launch_slots(["-np", "3", "--ctx-size", "9000"], 2, 8192, 4096) == (2, 8192, 8192)


def test_kv_unified_is_capped_like_separate_slots():
    """Unified slots share one cache, each up to the training context: 2 slots of a
    1,024-trained model can use 2,048 cells, where -c 8192 was allocated (a fresh tester's
    find)."""
    assert launch_slots(["--kv-unified"], 2, 4096, 1024) == (2, 1024, 4096)
    assert launch_slots(["--kv-unified"], 4, 256, 4096) == (4, 256, 256)
    assert launch_slots(["-np", "4", "-kvu"], 2, 4096, 1024) == (4, 1024, 2048)


def test_args_override_says_what_the_args_changed():
    assert args_override([], 3, 1024) == (3, 1024, "")
    assert args_override(["-np", "1"], 3, 1024) == (1, 3072, " (set by -np/-c in args)")
    assert args_override(["--ctx-size", "2048"], 2, 512) == (2, 1024, " (set by -np/-c in args)")
    n, per_slot, note = args_override(["-np", "4", "--kv-unified"], 4, 256)
    assert (n, per_slot) == (4, 1024) and "--kv-unified" in note
    # the last of -kvu / --no-kv-unified wins, as llama-server's argument parser reads them
    assert args_override(["-kvu", "--no-kv-unified"], 2, 512) == (2, 512, "")
