"""Engine plugins: SGLang (:mod:`fp4select.integrations.sglang`) and vLLM (:mod:`.vllm`).

Each engine finds its plugin through its own entry-point group (``sglang.srt.plugins``,
``vllm.general_plugins``, both named ``fp4select``); ``patch()`` / ``unpatch()`` do the same from
code. Nothing here imports an engine until a plugin runs, so importing this package is cheap.
"""
