"""vcap's patches against the real SGLang 0.5.23 source: every site exists with the signature
vcap was written for, and a changed one stops start-up with a message naming it."""

import os
import subprocess
import sys
import textwrap

import pytest

from vcap.engine_hook import patches, sglang_plugin
from vcap.engine_hook.patches import Patch, PatchError


def test_running_against_a_verified_version():
    assert patches.sglang_version() in sglang_plugin.VERIFIED_ON


@pytest.mark.parametrize("patch", sglang_plugin.PATCHES, ids=lambda p: p.target.rsplit(".", 2)[-2] + "." + p.target.rsplit(".", 1)[-1])
def test_every_site_exists_with_the_verified_signature(patch):
    patches.check(patch)


def test_the_tp_group_offers_what_the_rank0_rule_calls():
    """``get_dp_tp_group()`` is SGLang's GroupCoordinator: vcap builds the mapped inboxes with its
    ``all_gather_object`` (over its CPU group) and falls back to its ``broadcast`` across nodes."""
    import inspect

    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.layers.dp_attention import get_dp_tp_group

    assert callable(get_dp_tp_group)
    assert list(inspect.signature(GroupCoordinator.all_gather_object).parameters) == ["self", "obj"]
    assert list(inspect.signature(GroupCoordinator.broadcast).parameters)[:3] == ["self", "input_", "src"]
    assert "cpu_group" in inspect.getsource(GroupCoordinator.all_gather_object)
    for attribute in ("rank_in_group", "world_size"):
        assert attribute in inspect.getsource(GroupCoordinator)


def test_changed_signature_is_refused_with_site_and_version(monkeypatch):
    import sglang.srt.speculative.dspark_components.dspark_verify as verify

    def accept_draft_tokens(*, candidates, target_logits, renamed_argument=None):
        raise AssertionError("never called")

    monkeypatch.setattr(verify, "accept_draft_tokens", accept_draft_tokens)
    site = next(p for p in sglang_plugin.PATCHES if p.target.endswith(".accept_draft_tokens"))
    with pytest.raises(PatchError) as error:
        patches.check(site)
    message = str(error.value)
    assert site.target in message and "SGLang 0.5.23" in message and "renamed_argument" in message


def test_missing_site_is_refused():
    ghost = Patch("sglang.srt.speculative.dspark_components.dspark_planner.DSparkVerifyPlanner"
                  ".compute_confidence_tensor", lambda *a: None, "after", ("self",), ("0.4.0",), "gone")
    with pytest.raises(PatchError, match="compute_confidence_tensor: not found in SGLang 0.5.23"):
        patches.check(ghost)


def _run_plugin(setup: str, body: str) -> subprocess.CompletedProcess:
    """The plugin in a fresh interpreter, as SGLang's load_plugins() would call it."""
    stubs = os.path.join(os.path.dirname(__file__), "stubs")
    code = "\n".join([
        "import os, sys", f"sys.path.insert(0, {stubs!r})", textwrap.dedent(setup),
        "from vcap.engine_hook import sglang_plugin", "sglang_plugin.register()", textwrap.dedent(body)])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_register_applies_every_patch_through_sglangs_registry():
    result = _run_plugin("os.environ['VCAP_SEGMENT'] = 'vcap-contract'", """
        import pkgutil
        from vcap.engine_hook.patches import _resolve, _wraps
        for patch in sglang_plugin.PATCHES:
            assert _wraps(_resolve(patch.target)[1], patch.hook), patch.target
        # the by-name copy in the sampling-accept graph module is rebound too
        import sglang.srt.speculative.dspark_components.dspark_sampling_accept_graph as graph
        from vcap.engine_hook.sglang_hooks import around_accept_draft_tokens
        assert _wraps(graph.accept_draft_tokens, around_accept_draft_tokens)
        print("applied", len(sglang_plugin.PATCHES))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"applied {len(sglang_plugin.PATCHES)}" in result.stdout


def test_plugin_is_inert_without_a_segment():
    result = _run_plugin("os.environ.pop('VCAP_SEGMENT', None)", """
        import sglang.srt.speculative.dspark_components.dspark_verify as verify
        assert not hasattr(verify.accept_draft_tokens, "__wrapped__")
        print("inert")
    """)
    assert result.returncode == 0 and "inert" in result.stdout, result.stderr[-3000:]


def test_fused_accept_tail_stops_start_up():
    result = _run_plugin("os.environ['VCAP_SEGMENT'] = 'x'; os.environ['SGLANG_DSPARK_FUSED_ACCEPT_TAIL'] = '1'", "")
    assert result.returncode != 0
    assert "SGLANG_DSPARK_FUSED_ACCEPT_TAIL=1" in result.stderr


def test_changed_site_stops_start_up_through_the_entry_point():
    result = _run_plugin("""
        os.environ['VCAP_SEGMENT'] = 'x'
        import sglang.kernels.ops.moe.moe_fused_gate as gate_module
        def moe_fused_gate(scores, bias, topk, new_flag=False): pass
        gate_module.moe_fused_gate = moe_fused_gate
    """, "")
    assert result.returncode != 0
    assert "moe_fused_gate.moe_fused_gate: SGLang 0.5.23 has parameters (scores, bias, topk, new_flag=False)" in result.stderr


def test_entry_point_is_declared():
    from importlib.metadata import entry_points
    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names.get("vcap") == "vcap.engine_hook.sglang_plugin:register"


def test_launch_enables_the_plugin_in_sglangs_environment():
    from vcap.engine_hook.launch import plugin_environment
    env = plugin_environment({"SGLANG_PLUGINS": "other"}, "vcap-7", "anchor")
    assert (env["VCAP_SEGMENT"], env["VCAP_DEAD_ROWS"], env["SGLANG_PLUGINS"]) == ("vcap-7", "anchor", "other,vcap")
    assert "SGLANG_PLUGINS" not in plugin_environment({}, "vcap-0", "drop")  # empty: all plugins load


def test_launch_execs_sglangs_launcher(tmp_path):
    """The real launcher up to SGLang's argument parsing (no GPU here: --help only)."""
    result = subprocess.run([sys.executable, "-m", "vcap.engine_hook.launch", "--segment", "vcap-9",
                             "--", "--help"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "stubs")})
    assert "creates /dev/shm/vcap-9" in result.stdout
    assert "--model-path" in result.stdout, result.stderr[-2000:]
