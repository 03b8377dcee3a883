"""SGLang loads a model's weights through the engine: a loader class to pass as ``load_format``.

SGLang has no registry of load format names (its ``LoadConfig`` checks names against a fixed
enum), but it accepts a loader *class* as ``load_format`` and instantiates it with the load
config.  It is not tested here against SGLang itself (SGLang's install needs CUDA builds of
its kernels); the weights it hands over are those the vLLM format's tests check.  Through
the offline engine::

    import sglang
    from engine.serving.sglang import loader_class

    llm = sglang.Engine(model_path="/models/llama", load_format=loader_class(),
                        model_loader_extra_config='{"threads": 8}')

The class builds the model as SGLang's default loader does, hands it the engine's weights
(:class:`engine.serving.weights.Weights`: the chunk ring to a GPU, zero-copy views on the CPU,
URLs with ``cache_dir``) and runs SGLang's post-processing of the weights.  The options are those of the vLLM format
(:data:`engine.serving.weights.OPTION_DOCS`); SGLang passes them as a JSON string or a dict.

SGLang is imported only when :func:`loader_class` is called.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from engine.serving.weights import Weights, parse_options, tp_group_of

__all__ = ["loader_class"]


@functools.cache
def loader_class() -> type:
    """The ``BaseModelLoader`` subclass to pass as SGLang's ``load_format`` (SGLang imported here)."""
    import torch
    from sglang.srt.model_loader import loader as sgl

    class EngineModelLoader(sgl.BaseModelLoader):
        """Loads safetensors weights with the engine; copies as for the vLLM format (see
        :mod:`engine.serving.weights`)."""

        def __init__(self, load_config) -> None:
            super().__init__(load_config)
            extra: Any = getattr(load_config, "model_loader_extra_config", None) or {}
            if isinstance(extra, str):
                extra = json.loads(extra)
            self.options = parse_options(extra, where="model_loader_extra_config")

        def download_model(self, model_config) -> None:
            from engine.serving.weights import checkpoint_files

            source = self.options.weights or model_config.model_path
            if os.path.exists(source):
                checkpoint_files(source, max_header_size=self.options.max_header_size)

        def load_model(self, *, model_config, device_config):
            source = self.options.weights or model_config.model_path
            target = torch.device(device_config.device)
            device = f"cuda:{target.index if target.index is not None else torch.cuda.current_device()}" \
                if target.type == "cuda" else "cpu"
            with sgl.set_default_torch_dtype(model_config.dtype):
                with target:
                    model = sgl._initialize_model(model_config, self.load_config)
                from sglang.srt.distributed import parallel_state

                with Weights(source, device=device, options=self.options, group=tp_group_of(parallel_state)) as weights:
                    sgl.DefaultModelLoader.load_weights_and_postprocess(model, iter(weights), target)
            return model.eval()

    EngineModelLoader.__module__ = __name__
    EngineModelLoader.__qualname__ = "EngineModelLoader"
    return EngineModelLoader
