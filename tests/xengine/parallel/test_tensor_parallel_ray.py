"""Tensor parallelism across Ray nodes: two Ray nodes on this box (``ray.cluster_utils.Cluster``), a
placement group with one bundle per rank spread over them; the ranks meet over TCP and, being on
different nodes, all-reduce through gloo. Greedy tokens identical to HF; a killed rank takes the
instance down loudly (never a hang) and its placement group is released.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.xengine.test_engine_parity import MAX_TOKENS, make_prompts
from xengine.api.messages import AddRequest, SamplingParams
from xengine.llm import LLM
from xengine.step.execute import EngineBrokenError


@pytest.fixture(scope="module")
def two_nodes():
    pytest.importorskip("ray", reason="ray not installed: run ci/install_cluster_deps.sh")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1}, connect=False)
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        yield cluster.address
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def test_tp2_over_two_ray_nodes_gives_hf_tokens_then_fails_loudly_on_a_killed_rank(
    make_model_dir, hf_oracle, two_nodes: str
) -> None:
    import ray

    prompts = make_prompts(seed=80)[:6]
    oracle = hf_oracle("qwen3")
    expected = [oracle.greedy(p, MAX_TOKENS) for p in prompts]
    llm = LLM(
        str(make_model_dir("qwen3")),
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        ray_address=two_nodes,
        placement_strategy="STRICT_SPREAD",
        num_threads=1,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        par = llm.engine.get_stats().moe
        assert par.tensor_parallel_size == 2 and par.all_reduce == "torch.distributed"  # two hosts: gloo
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2
        (rank1,) = llm.engine.parallel.procs
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        llm.engine.add_request(AddRequest(req_id="r", prompt_token_ids=[5, 6, 7], params=long))
        llm.engine.step()
        os.kill(rank1.pid, signal.SIGKILL)  # one box: the other node's worker process is visible here
        t0 = time.monotonic()
        with pytest.raises(EngineBrokenError, match="worker rank 1 .* exited"):
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
        assert time.monotonic() - t0 < 60  # a hang guard, not a timing claim
    finally:
        llm.shutdown()
    assert not [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
