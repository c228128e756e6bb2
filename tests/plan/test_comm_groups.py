"""composer plan's communication at 4 gloo ranks, where the mesh dimensions are different groups:
each collective's bytes equal the plan's for its group (tests/plan/test_comm.py's counting)."""

import pytest

from tests.plan.test_comm import check_counted

# at 4 ranks the groups differ: each dimension with data parallelism (FSDP2 under a
# pipeline schedule, expert FSDP units over dp_outer, replicated experts reduced over
# dp_outer), and tp with cp
CASES = [
    ("llama-debug", {"tp": 2}),
    ("llama-debug", {"pp": 2, "global_batch_size": 8}),
    ("qwen3-moe-debug", {"ep": 2, "global_batch_size": 8}),
    ("qwen3-moe-debug", {"ep": 2, "dp_mode": "replicate", "global_batch_size": 4}),
    ("nemotron-h-debug", {"cp": 2, "tp": 2, "global_batch_size": 2}),
    ("llama-debug", {"dp_replicate": 2, "global_batch_size": 8}),  # HSDP
]


@pytest.mark.slow
@pytest.mark.distributed
def test_planned_bytes_equal_a_counted_step_by_group():
    check_counted(CASES, 4)
