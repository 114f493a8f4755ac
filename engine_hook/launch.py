"""Start SGLang with vcap's plugin on: ``python -m vcap.engine_hook.launch [--segment NAME] -- <args>``.

Everything after ``--`` goes to ``python -m sglang.launch_server``. The plugin is enabled in
every scheduler process through ``VCAP_SEGMENT``; TP rank 0 creates ``/dev/shm/<NAME>`` when the
model warms up, and ``vcap-sidecar --segment NAME`` attaches to it.
"""

import argparse
import os
import sys

from vcap.segment import segment_path

__all__ = ["main", "plugin_environment"]


def plugin_environment(environ: dict, segment: str, dead_rows: str) -> dict:
    """The environment SGLang needs to load vcap's plugin in every process."""
    env = dict(environ)
    env["VCAP_SEGMENT"] = segment
    env["VCAP_DEAD_ROWS"] = dead_rows
    whitelist = [name for name in env.get("SGLANG_PLUGINS", "").split(",") if name.strip()]
    if whitelist and "vcap" not in whitelist:  # empty means every plugin loads
        env["SGLANG_PLUGINS"] = ",".join(whitelist + ["vcap"])
    return env


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m vcap.engine_hook.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segment", default="vcap-0", help="segment name in /dev/shm (default: vcap-0)")
    parser.add_argument("--dead-rows", choices=("drop", "anchor"), default="drop",
                        help="dead verify rows: id -1/weight 0 (drop), or the anchor's experts (anchor)")
    args = parser.parse_args(argv[:cut])
    sglang_args = argv[cut + 1:]
    if not sglang_args:
        parser.error("give SGLang's launch_server arguments after --")
    env = plugin_environment(os.environ, args.segment, args.dead_rows)
    print(f"vcap: SGLang starts with vcap's plugin; TP rank 0 creates {segment_path(args.segment)} "
          f"when the model warms up. Attach with: vcap-sidecar --segment {args.segment}", flush=True)
    command = [sys.executable, "-m", "sglang.launch_server", *sglang_args]
    os.execvpe(command[0], command, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
