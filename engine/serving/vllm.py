"""The vLLM load format ``safetensors_engine``: vLLM loads a model's weights through the engine.

Installed with the package (``pip install "safetensors-engine[vllm]"``), it is registered by
an entry point of the group ``vllm.general_plugins`` (:func:`register`, which vLLM calls in
each of its processes), so that::

    vllm serve MODEL --load-format safetensors_engine
    vllm serve MODEL --load-format safetensors_engine --model-loader-extra-config '{"threads": 8}'
    LLM(model=MODEL, load_format="safetensors_engine")

load the weights with the engine: through the chunk ring to the model's GPU, or as zero-copy
views (or owned tensors) on the CPU; sharded checkpoints, ``*.safetensors.index.json``, and
``http(s)://`` / ``s3://`` weights (vLLM's ``model_weights``, or the ``weights`` option) with
``cache_dir``.  The options are those of :data:`engine.serving.weights.OPTION_DOCS`; with
tensor parallelism, URL weights are read once by the workers between them (the ``distributed``
option: on by default for URL weights on the CPU, ``true`` for GPU servers; :func:`tp_group`).

vLLM is imported only when :func:`register` or :func:`loader_class` is called.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

from engine.base._files import is_url
from engine.serving.weights import Weights, check_loaded, parse_options, stage_select, tp_group_of

__all__ = ["LOAD_FORMAT", "register", "loader_class", "load_device", "exempt_parameters", "tp_group"]

#: the name users pass as ``--load-format`` (vLLM lower-cases load formats)
LOAD_FORMAT = "safetensors_engine"

_lock = threading.Lock()


def register() -> None:
    """Register the load format with vLLM (the ``vllm.general_plugins`` entry point).

    Idempotent: vLLM calls it in every process it starts, and a second call (or a call after
    vLLM registered it some other way) leaves the registration as it is, without vLLM's
    warning about overwriting a format.
    """
    from vllm.model_executor import model_loader

    cls = loader_class()
    with _lock:
        table = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", None)
        if table is not None and table.get(LOAD_FORMAT) is cls:
            return
        model_loader.register_model_loader(LOAD_FORMAT)(cls)


def load_device(model: Any) -> str:
    """Where the model's weights are: the device of its first parameter that has storage
    (``"cuda:N"`` with its index, or ``"cpu"``); ``"cpu"`` for a model with none."""
    for p in model.parameters():
        dev = p.device
        if dev.type == "meta":
            continue
        if dev.type == "cuda":
            import torch

            return f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
        return dev.type
    return "cpu"


def exempt_parameters(model: Any, quantized: bool) -> set[str]:
    """The parameters that vLLM's own check of a load does not require from the checkpoint
    (``DefaultModelLoader.track_weights_loading``): those of modules whose quantization method
    quantizes online or processes weights after loading; for a quantized model only those
    that no checkpoint can carry (online quantization, KV-cache scales, empty placeholders)."""
    out: set[str] = set()
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        online = getattr(method, "uses_meta_device", False)
        post = getattr(method, "process_weights_after_loading", None)
        if not (online or post):
            continue
        kv_cache = type(method).__name__ == "BaseKVCacheMethod" or any(
            c.__name__ == "BaseKVCacheMethod" for c in type(method).__mro__
        )
        for pname, param in module.named_parameters():
            if quantized and not online and not kv_cache and param.numel() > 0 and \
                    pname.rsplit(".", 1)[-1] != "input_scale_ub":
                continue
            out.add(f"{name}.{pname}" if name else pname)
    return out


def tp_group() -> Any:
    """The gloo side of this worker's tensor-parallel group, or None without one (see
    :func:`engine.serving.weights.tp_group_of`)."""
    from vllm.distributed import parallel_state

    return tp_group_of(parallel_state)


def pipeline_stage(model) -> Any:
    """With pipeline parallelism, which tensors this worker's stage reads
    (:func:`engine.serving.weights.stage_select` over the model's names): each stage's
    workers read their own layers, not the whole checkpoint.  None with one stage."""
    from vllm.distributed import parallel_state

    pp = getattr(parallel_state, "_PP", None)
    if pp is None or getattr(pp, "world_size", 1) < 2:
        return None
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    return stage_select(names)


@functools.cache
def loader_class() -> type:
    """The ``BaseModelLoader`` subclass of the load format (vLLM imported here)."""
    from vllm.logger import init_logger
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    logger = init_logger("vllm.safetensors_engine")

    class EngineModelLoader(BaseModelLoader):
        """Loads safetensors weights with the engine (the ``safetensors_engine`` load format).

        Copies of tensor bytes: on a GPU 2 by the engine (page cache to a page-locked chunk,
        DMA) plus vLLM's copy into each parameter on the device; on the CPU, with
        ``cpu="view"``, none by the engine (views of a private mapping) and vLLM's copy into
        each parameter; ``cpu="owned"`` adds one.  See :mod:`engine.serving.weights`.
        """

        def __init__(self, load_config) -> None:
            super().__init__(load_config)
            # a bad option fails when the engine starts, not after the model is built
            self.options = parse_options(load_config.model_loader_extra_config)

        def weights_source(self, model_config) -> str:
            """The weights' path or URL: the ``weights`` option, vLLM's ``model_weights``
            (an object-store URL whose config vLLM pulled), the model's path, or the local
            folder of a Hugging Face repository downloaded as vLLM downloads it."""
            source = self.options.weights or getattr(model_config, "model_weights", "") or model_config.model
            if is_url(source) or os.path.exists(source):
                return source
            from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

            return download_weights_from_hf(
                source, self.load_config.download_dir, ["*.safetensors", "*.safetensors.index.json"],
                model_config.revision, ignore_patterns=self.load_config.ignore_patterns,
            )

        def download_model(self, model_config) -> None:
            source = self.weights_source(model_config)
            if not is_url(source):
                from engine.serving.weights import checkpoint_files

                checkpoint_files(source, max_header_size=self.options.max_header_size)

        def load_weights(self, model, model_config) -> None:
            source = self.weights_source(model_config)
            started = time.perf_counter()
            with Weights(source, device=load_device(model), options=self.options, group=tp_group(),
                         select=pipeline_stage(model)) as weights:
                loaded = model.load_weights(iter(weights))
            # the same line as vLLM's default loader, over the same span (iterator to the end
            # of the model's load_weights), so that the two can be compared from the logs
            logger.info("Loading weights took %.2f seconds", time.perf_counter() - started)
            if self.options.stats:
                logger.info("%s", weights.summary())
            if model_config.quantization is None and loaded is not None:
                names = [n for n, _ in model.named_parameters()]
                check_loaded(names, loaded, exempt_parameters(model, quantized=False), source=source)

    EngineModelLoader.__module__ = __name__
    EngineModelLoader.__qualname__ = "EngineModelLoader"
    return EngineModelLoader
