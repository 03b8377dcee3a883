"""Inference servers load through the engine.

* vLLM: the load format ``safetensors_engine`` (:mod:`engine.serving.vllm`), registered by
  the ``vllm.general_plugins`` entry point once ``safetensors-engine[vllm]`` is installed:
  ``vllm serve MODEL --load-format safetensors_engine``.
* SGLang: a loader class to pass as ``load_format`` (:mod:`engine.serving.sglang`).
* What both hand to the model, their options and the copies: :mod:`engine.serving.weights`.

Importing this package imports no server, no torch and no numpy.
"""

from __future__ import annotations

#: the name of the vLLM load format (``--load-format``)
LOAD_FORMAT = "safetensors_engine"

__all__ = ["LOAD_FORMAT"]
