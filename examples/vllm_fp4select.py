"""Serve an NVFP4 checkpoint with vLLM, each FlashInfer FP4 GEMM run by the backend fp4select picks.

The server form (one setting, vLLM's own plugin allow-list):

    VLLM_PLUGINS=fp4select vllm serve nvidia/Llama-3.1-8B-Instruct-FP4 \\
        --quantization modelopt_fp4 --linear-backend flashinfer_cutlass

This file does the same with vLLM's offline LLM on a Blackwell GPU:

    python examples/vllm_fp4select.py --model nvidia/Llama-3.1-8B-Instruct-FP4

and, anywhere vLLM is installed (a CPU is enough), checks that vLLM's own plugin loader finds
and applies fp4select without starting a model:

    python examples/vllm_fp4select.py --check

``--linear-backend`` must be a ``flashinfer_*`` one (or ``auto``, which picks FlashInfer's
cute-dsl or cutlass kernels on SM100): vLLM's own ``cutlass``, ``marlin`` or ``emulation``
kernels do not call flashinfer.mm_fp4 and are untouched. ``flashinfer_trtllm`` shuffles the
weights at load; fp4select then selects only among backends that read that layout.
``VLLM_PLUGINS`` replaces vLLM's default of loading every plugin: list any others you use too.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

# Before vLLM starts: every vLLM process (engine core, each GPU worker) reads the allow-list.
os.environ.setdefault("VLLM_PLUGINS", "fp4select")


def check() -> int:
    import flashinfer
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does at start
    patched = getattr(flashinfer.mm_fp4, "__fp4select__", False)
    print(f"flashinfer.mm_fp4 (called by vllm::flashinfer_mm_fp4) is fp4select's: {patched}")
    return 0 if patched else 1


def serve(model: str, backend: str) -> int:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, quantization="modelopt_fp4", linear_backend=backend)
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    print(out[0].outputs[0].text)
    print("decisions: run `fp4select show` to see which backend won each shape")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only check the plugin is applied")
    parser.add_argument("--model", default="nvidia/Llama-3.1-8B-Instruct-FP4")
    parser.add_argument(
        "--linear-backend",
        default="flashinfer_cutlass",
        help="vLLM's --linear-backend (a flashinfer_* one; the layout fp4select selects within)",
    )
    args = parser.parse_args()
    missing = [name for name in ("vllm", "flashinfer") if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"{' and '.join(missing)} not installed: this example needs vLLM and flashinfer "
            "(pip install vllm==0.34.0 flashinfer-python; fp4select's plugin is tested with "
            "vLLM 0.34.0 and 0.33.0)",
            file=sys.stderr,
        )
        return 1
    return check() if args.check else serve(args.model, args.linear_backend)


if __name__ == "__main__":
    raise SystemExit(main())
