"""Copy the @triton.jit kernels the benchmarks and GPU tests compare against out of the sglang
0.5.23 wheel into bench/_sgl/ (git-ignored; never committed; carried to the device):
the bf16 fused-MoE kernels and the router kernel behind ``moe_fused_gate``.

    pip download --no-deps sglang==0.5.23 -d /tmp/sgl
    python3 bench/vendor_sgl.py /tmp/sgl/sglang-0.5.23-*.whl
"""
import ast
import os
import sys
import zipfile

SOURCES = {
    "sgl_moe_kernels.py": ("sglang/kernels/ops/moe/fused_moe_triton_kernels.py",
                           ["write_zeros_to_output", "fused_moe_kernel", "tanh", "_apply_activation",
                            "act_and_mul_kernel", "_moe_sum_reduce_kernel"]),
    "sgl_router_kernel.py": ("sglang/kernels/ops/moe/moe_fused_gate.py", ["_router_triton_kernel"]),
}


def main(wheel: str) -> None:
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sgl")
    os.makedirs(out_dir, exist_ok=True)
    archive = zipfile.ZipFile(wheel)
    for target, (source, wanted) in SOURCES.items():
        text = archive.read(source).decode()
        lines = text.splitlines()
        chunks = {}
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and node.name in wanted:
                start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
                chunks[node.name] = "\n".join(lines[start:node.end_lineno])
        missing = [w for w in wanted if w not in chunks]
        if missing:
            sys.exit(f"{source}: not found: {missing}")
        header = (f"# Verbatim @triton.jit kernels from {os.path.basename(wheel)}:{source}\n"
                  "# (Apache-2.0, sgl-project). Extracted by bench/vendor_sgl.py; not part of vcap.\n"
                  "import triton\nimport triton.language as tl\n"
                  "from triton.language.extra import libdevice\n\n\n")
        with open(os.path.join(out_dir, target), "w") as f:
            f.write(header + "\n\n\n".join(chunks[w] for w in wanted) + "\n")
        print("wrote", os.path.join(out_dir, target), sorted(chunks))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
