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

__all__ = ["refuse_unsupported_environment", "before_scheduler_init", "check_server_layout", "dispatch_row_bytes"]

_TRUE = ("1", "true", "yes", "on")
# DeepEP's low-latency message (csrc/kernels/internode_ll.cu, num_bytes_per_msg): an int4 header
# (the token's index at the source), then the hidden state: FP8 with one float32 scale per 128
# channels, or bf16.
_DEEPEP_MSG_HEADER = 16
_FP8_SCALE_GROUP = 128
# MoE runners that quantize the hidden state themselves: DeepEP then dispatches bf16
# (sglang.srt.layers.moe.utils.get_deepep_output_dtype, step 5).
_BF16_RUNNERS = ("flashinfer_cutedsl", "cutlass", "humming")


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


def _value(option) -> str:
    return str(getattr(option, "value", option) or "none")


def dispatch_row_bytes(server_args, model_config) -> int:
    """Bytes one verify row sends in the MoE's all-to-all dispatch, from SGLang 0.5.23's server
    arguments (``ServerArgs`` fields ``moe_a2a_backend``, ``deepep_mode``,
    ``deepep_dispatcher_output_dtype``, ``moe_runner_backend``) and the model's config
    (``hidden_size``, ``num_experts_per_tok``: the HF config or SGLang's ``ModelConfig``). A dead
    row (expert id -1) sends none of it. 0: no dispatch (``--moe-a2a-backend none``), or a wire
    format this function does not know (the sidecar's ``--dispatch-row-bytes`` can say it).

    DeepEP (``deepep``): a verify batch is not an extend batch, so ``deepep_mode`` ``auto``
    dispatches it low-latency, one message per (row, routed expert): ``top_k x (16 + H + 4 H/128)``
    in FP8 (the default dtype; ``int8`` is FP8 on a GPU) or ``top_k x (16 + 2 H)`` in bf16 (asked
    for, ``SGLANG_DEEPEP_BF16_DISPATCH``, or a runner that quantizes itself). ``normal`` mode sends
    each row once per destination rank (one copy counted: a lower bound), FP8 only where DeepGEMM's
    JIT quantizes it first. On Blackwell DeepGEMM packs the scales as UE8M0 (1 byte, not 4): the
    figure there is 3 bytes per 128 channels high. NVFP4 dispatch and the other backends: 0.
    """
    backend = _value(server_args.moe_a2a_backend)
    if backend != "deepep":
        return 0
    hidden = int(model_config.hidden_size)
    top_k = int(getattr(model_config, "num_experts_per_tok", 0)
                or model_config.hf_config.num_experts_per_tok)
    dtype = _value(server_args.deepep_dispatcher_output_dtype)
    if dtype == "auto":
        from sglang.srt.environ import envs
        bf16 = envs.SGLANG_DEEPEP_BF16_DISPATCH.get() or _value(server_args.moe_runner_backend) in _BF16_RUNNERS
        dtype = "bf16" if bf16 else "fp8"
    dtype = "fp8" if dtype == "int8" else dtype
    if dtype not in ("fp8", "bf16"):
        return 0
    fp8_bytes = hidden + 4 * -(-hidden // _FP8_SCALE_GROUP)
    if _value(server_args.deepep_mode) == "normal":
        return fp8_bytes if dtype == "fp8" and _jit_deepgemm() else 2 * hidden
    return top_k * (_DEEPEP_MSG_HEADER + (fp8_bytes if dtype == "fp8" else 2 * hidden))


def _jit_deepgemm() -> bool:
    """DeepEP's normal dispatch sends FP8 only when DeepGEMM's JIT quantized the rows first."""
    try:
        from sglang.srt.layers import deep_gemm_wrapper
    except Exception:   # no GPU stack here (a CPU test): no DeepGEMM
        return False
    return bool(deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM)
