"""The plugin's one patch of vLLM: each decode step schedules a request the rows its window
needs (``canvas: "live"``, docs/vllm.md "Rows fed").

vLLM sizes a diffusion request's next canvas from the draft token list its model runner
reports after a step: ``GPUModelRunner.take_draft_token_ids`` returns
``DraftTokensHandler.get_draft_tokens()``, which (no structured outputs, no asynchronous
scheduling) is ``[-1] * canvas_length`` per request, and ``DiffusionScheduler`` schedules
as many query rows as the list is long. No public hook lets a model state shorten that
list, so :func:`install` wraps the one method: the runner's list, passed through the model
state's ``next_canvas`` when it has one (other models are untouched). The counts come from
the step's own output, which vLLM has already brought to the host by then (the engine core
calls this after ``update_from_output``): nothing waits for the device.

The patch is for the vLLM releases in :data:`PATCHED_VERSIONS` only (local builds of them
included), where the wrapped method was read. On another release, or where the method is
not the one read, the engine feeds the fixed canvas with a warning when the canvas was left
to its default, and refuses to start when ``canvas: "live"`` was asked for by name;
``canvas: "fixed"`` runs without the patch.
"""

from typing import Any

PATCHED_VERSIONS = ("0.32.0",)
# What GPUModelRunner.take_draft_token_ids reads in those releases (its whole body is
# ``return self.draft_tokens_handler.get_draft_tokens()``): a different method is not
# wrapped.
_EXPECTED_NAMES = ("draft_tokens_handler", "get_draft_tokens")


class LiveCanvasError(RuntimeError):
    """The installed vLLM is not one this patch was written for."""


def is_patched_version(version: str) -> bool:
    """Whether ``version`` (``vllm.__version__``) is a release the plugin's patches of vLLM
    were written for; a local build of one (``0.32.0+cu130``) counts as that release."""
    return version.split("+", 1)[0] in PATCHED_VERSIONS


def check_version(version: str) -> None:
    """Refuse ``canvas: "live"`` on a vLLM release the patch was not written for."""
    if not is_patched_version(version):
        raise LiveCanvasError(
            f'additional_config["wedlm"]["canvas"] = "live" patches vLLM\'s '
            f"GPUModelRunner.take_draft_token_ids, written for vLLM {list(PATCHED_VERSIONS)}; "
            f'this is vLLM {version}. Set "canvas": "fixed" (2W rows per request per step) '
            "to run without the patch")


def install() -> None:
    """Wrap ``GPUModelRunner.take_draft_token_ids`` (idempotent; in the worker process)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    method = GPUModelRunner.take_draft_token_ids
    if getattr(method, "_wedlm_original", None) is not None:
        return
    if method.__code__.co_names != _EXPECTED_NAMES:
        raise LiveCanvasError(
            "vLLM's GPUModelRunner.take_draft_token_ids is not the method the live canvas "
            f'patch wraps (it reads {method.__code__.co_names}); set additional_config'
            '["wedlm"]["canvas"] = "fixed"')

    def take_draft_token_ids(self) -> Any:
        drafts = method(self)
        next_canvas = getattr(self.model_state, "next_canvas", None)
        return drafts if drafts is None or next_canvas is None else next_canvas(drafts)

    take_draft_token_ids._wedlm_original = method
    take_draft_token_ids.__doc__ = method.__doc__
    GPUModelRunner.take_draft_token_ids = take_draft_token_ids


def installed() -> bool:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    return getattr(GPUModelRunner.take_draft_token_ids, "_wedlm_original", None) is not None
