"""Serve an NVFP4 checkpoint with SGLang, each dense FP4 GEMM run by the backend fp4select picks.

The server form (one setting, SGLang's own plugin allow-list):

    SGLANG_PLUGINS=fp4select python -m sglang.launch_server \\
        --model-path nvidia/Llama-3.1-8B-Instruct-FP4 --quantization modelopt_fp4 \\
        --fp4-gemm-backend flashinfer_cutlass

This file does the same with SGLang's offline Engine on a Blackwell GPU:

    python examples/sglang_fp4select.py --model nvidia/Llama-3.1-8B-Instruct-FP4

and, anywhere SGLang is installed (a CPU is enough), checks that SGLang's own plugin loader
finds and applies fp4select without starting a model:

    python examples/sglang_fp4select.py --check

``--fp4-gemm-backend`` names the weight layout SGLang prepares at load: ``flashinfer_trtllm``
shuffles the weights, the other flashinfer backends keep the plain layout; fp4select selects
among the backends that read that layout (``marlin`` does not call flashinfer and is untouched).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

# Before SGLang starts: its scheduler processes (which run the GEMMs) read the allow-list.
os.environ.setdefault("SGLANG_PLUGINS", "fp4select")


def check() -> int:
    import flashinfer
    from sglang.srt.layers.quantization import modelopt_quant
    from sglang.srt.plugins import load_plugins

    load_plugins()  # what every SGLang process does at start
    patched = getattr(modelopt_quant.flashinfer_fp4_gemm, "__fp4select__", False)
    print(f"SGLang's FP4 GEMM is fp4select's: {patched}")
    print(f"flashinfer.mm_fp4 untouched: {not getattr(flashinfer.mm_fp4, '__fp4select__', False)}")
    return 0 if patched else 1


def serve(model: str, backend: str) -> int:
    import sglang as sgl

    llm = sgl.Engine(model_path=model, quantization="modelopt_fp4", fp4_gemm_runner_backend=backend)
    try:
        out = llm.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        print(out["text"])
    finally:
        llm.shutdown()
    print("decisions: run `fp4select show` to see which backend won each shape")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only check the plugin is applied")
    parser.add_argument("--model", default="nvidia/Llama-3.1-8B-Instruct-FP4")
    parser.add_argument(
        "--fp4-gemm-backend",
        default="flashinfer_cutlass",
        help="SGLang's --fp4-gemm-backend (the weight layout fp4select selects within)",
    )
    args = parser.parse_args()
    missing = [name for name in ("sglang", "flashinfer") if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"{' and '.join(missing)} not installed: this example needs SGLang and flashinfer "
            "(pip install sglang==0.5.23 flashinfer-python; fp4select's plugin is tested with "
            "SGLang 0.5.23)",
            file=sys.stderr,
        )
        return 1
    return check() if args.check else serve(args.model, args.fp4_gemm_backend)


if __name__ == "__main__":
    raise SystemExit(main())
