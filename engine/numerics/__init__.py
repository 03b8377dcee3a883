"""Arithmetic on tensor bytes: the Numba kernels and what is built on them.

- :mod:`~engine.numerics.kernels`: every CPU kernel, in one file (Numba's on-disk cache is
  keyed on the defining file); :mod:`~engine.numerics.cuda_kernels`: every CUDA kernel, the
  same way;
- :mod:`~engine.numerics._arrays`: what the kernels share about arrays (float formats,
  framework arrays as numpy, axes);
- :mod:`~engine.numerics.statistics` (per-tensor statistics, :func:`engine.stats`),
  :mod:`~engine.numerics.quantize` (int8 quantization of one array,
  :func:`engine.quantize_int8`) and :mod:`~engine.numerics.device` (both on a CUDA device).

Their public names are reached through :mod:`engine.statistics`, :mod:`engine.quantize` and
:mod:`engine.device`.  Importing this package imports nothing: Numba comes with the first
kernel module.
"""
