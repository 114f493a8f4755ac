"""SGLang modes vcap cannot keep exact, refused at start-up (the table is in docs/sglang.md).

Two checks, both before the model loads:

- :func:`refuse_unsupported_environment`, from the plugin's ``register()`` in every process:
  the environment switches SGLang reads (ragged verify mode, simulated acceptance, fused accept
  tail) and vcap's own.
- :func:`before_scheduler_init`, before ``Scheduler.__init__``: the resolved server arguments.
  In the scheduler process SGLang loads plugins *before* it publishes its config, so
  ``register()`` cannot read them; ``Scheduler.__init__`` runs after ``publish`` and before the
  model is built. A refusal there is a :class:`PatchError`: SGLang logs "Scheduler hit an
  exception" with vcap's message and stops the server.
"""

import os

from .patches import PatchError

__all__ = ["refuse_unsupported_environment", "before_scheduler_init", "check_server_layout"]

_TRUE = ("1", "true", "yes", "on")


def refuse_unsupported_environment() -> None:
    """Raises PatchError for an environment switch under which vcap would be silently wrong."""
    from sglang.srt.environ import envs
    from sglang.srt.speculative.ragged_verify import RaggedVerifyMode, read_ragged_verify_mode

    if os.environ.get("SGLANG_DSPARK_FUSED_ACCEPT_TAIL", "").strip().lower() in _TRUE:
        raise PatchError("SGLANG_DSPARK_FUSED_ACCEPT_TAIL=1 accepts in one kernel that takes no cutoff; "
                         "vcap cannot cap acceptance there. Unset it to run with vcap.")
    dead_rows = os.environ.get("VCAP_DEAD_ROWS", "drop")
    if dead_rows not in ("drop", "anchor"):
        raise PatchError(f"VCAP_DEAD_ROWS must be 'drop' or 'anchor', got {dead_rows!r}")
    group = os.environ.get("VCAP_SEGMENT_GROUP", "").strip()
    if group and not group.isdigit():
        import grp
        try:
            grp.getgrnam(group)
        except KeyError:
            raise PatchError(f"VCAP_SEGMENT_GROUP={group!r}: no such group on this host") from None
    try:
        mode = read_ragged_verify_mode()
    except ValueError as error:
        raise PatchError(str(error)) from None
    if mode is RaggedVerifyMode.COMPACT:
        raise PatchError("SGLANG_RAGGED_VERIFY_MODE=compact packs each request's verify rows together; "
                         "vcap's router maps rows to requests by a fixed stride, so it would drop live rows "
                         "of other requests. Use SGLANG_RAGGED_VERIFY_MODE=static or cap-accept "
                         "(vcap caps at the smaller of its length and SGLang's).")
    if envs.SGLANG_SIMULATE_ACC_LEN.get() > 0:
        raise PatchError(f"SGLANG_SIMULATE_ACC_LEN={envs.SGLANG_SIMULATE_ACC_LEN.get()} is a benchmarking "
                         "switch that replaces the accepted length after the accept, so vcap's cap cannot "
                         "hold. Unset it (or set it to -1) to run with vcap.")


def check_server_layout() -> None:
    """Raises PatchError for a resolved server layout vcap does not follow (SGLang's config bags)."""
    from sglang.srt.runtime_context import get_exec, get_parallel, get_spec

    parallel, exec_ = get_parallel(), get_exec()
    backend = str(getattr(exec_.moe.moe_a2a_backend, "value", exec_.moe.moe_a2a_backend) or "none")
    attn_tp_size = int(getattr(parallel, "attn_tp_size", 1) or 1)
    if backend != "none" and attn_tp_size > 1:
        raise PatchError(f"--moe-a2a-backend {backend} with {attn_tp_size} attention-TP ranks per DP rank gives "
                         "each of them a slice of the verify rows (SGLang's tensor_split); vcap's row map "
                         "follows the slices (engine_hook/row_map.py, tested on the CPU) but is not yet bound "
                         "to SGLang's sliced forward on GPUs. Run with one attention-TP rank per DP rank "
                         "(--attn-dp-size = --tp-size), --moe-a2a-backend none, or without vcap.")
    if parallel.attn_dp_enabled and backend == "none":
        raise PatchError("attention data parallelism (--attn-dp-size / --enable-dp-attention) with a TP MoE "
                         "gathers the rows of all DP ranks before the MoE; vcap's row map follows the gather "
                         "(engine_hook/row_map.py, tested on the CPU) but is not yet bound to it on GPUs. Use "
                         "an all-to-all backend with --attn-dp-size = --tp-size, or run without vcap.")
    if exec_.overlap.enable_two_batch_overlap:
        raise PatchError("two-batch overlap (--enable-two-batch-overlap) splits the verify into micro-batches; "
                         "vcap's row map follows them (tested on the CPU), but the gate cannot yet tell which "
                         "micro-batch it routes. Run without it, or without vcap.")
    if parallel.dwdp_size > 1:
        raise PatchError(f"--dwdp-size {parallel.dwdp_size} scatters the MoE's rows across ranks; vcap's "
                         "dead-row mask does not follow them. Run without DWDP, or without vcap.")
    if parallel.attn_cp_size > 1:
        raise PatchError(f"--attn-cp-size {parallel.attn_cp_size} lays the verify rows out per context-parallel "
                         "rank; vcap does not follow that layout. Run without attention CP, or without vcap.")
    if parallel.pp_size > 1:
        raise PatchError(f"--pp-size {parallel.pp_size}: pipeline parallelism is not supported by vcap (every "
                         "stage would create the same segment). Run with --pp-size 1, or without vcap.")
    if get_spec().speculative_use_block_verification:
        raise PatchError("--speculative-use-block-verification decides the accepted length from every verify "
                         "row, the dead ones included, so a capped verify would not commit what a verify "
                         "with k drafts commits. Run without it, or without vcap.")


def before_scheduler_init(scheduler, server_args, port_args):
    """``Scheduler.__init__`` (before): the resolved layout, checked before the model loads."""
    check_server_layout()
    return None
