"""Weight validator: check a checkpoint against what its ``config.json`` says it must hold.

From a Hugging Face ``config.json`` of the LLaMA family (LLaMA, Mistral, Qwen2 with
attention biases, BitNet with its sub-norms), :class:`WeightValidator` derives the expected
tensor names and shapes, then walks a checkpoint (one file or a sharded index) tensor by
tensor and reports missing, unexpected and mis-shaped tensors, mixed dtypes, tensors with
NaN or Inf, the parameter count against the expectation, per-tensor statistics and
outliers.  Memory stays bounded: each tensor is a view of a mapping, summarised by the
statistics kernel, and dropped before the next.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.base.dtypes import BY_NAME
from engine.errors import ConfigError, MissingDependencyError

__all__ = ["WeightValidator", "ValidationReport", "ConfigError", "expected_tensors", "KNOWN_MODEL_TYPES",
           "shape_checks_skipped"]

#: the ``model_type`` values whose tensor names and shapes :func:`expected_tensors` derives
KNOWN_MODEL_TYPES = ("llama", "mistral", "qwen2", "bitnet")


_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

# tensors some exporters add that carry no weights of the architecture
_IGNORABLE = (re.compile(r".*\.rotary_emb\.inv_freq$"), re.compile(r".*\.weight_scale$"))


def _int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config key {key!r} must be a positive integer, got {value!r}", reason="InvalidConfig")
    return value


def shape_checks_skipped(config: Mapping[str, Any]) -> str | None:
    """Why the shape checks cannot run against ``config`` (an architecture the validator
    does not know: GPT-2, BERT, T5 ...), or None when they can.

    A config naming a known ``model_type``, or naming none but holding every key the LLaMA
    family's shapes need, is checked (and a known one that lacks keys is an error, from
    :func:`expected_tensors`)."""
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type.lower() in KNOWN_MODEL_TYPES:
        return None
    if model_type is None and all(k in config for k in _REQUIRED):
        return None
    known = ", ".join(KNOWN_MODEL_TYPES)
    if model_type is None:
        missing = [k for k in _REQUIRED if k not in config]
        return (f"the config names no model_type and lacks {missing}: the shape checks know the LLaMA "
                f"family only ({known})")
    return f"model_type {model_type!r} is not an architecture the shape checks know ({known})"


def expected_tensors(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names and shapes a LLaMA-family checkpoint with this config must hold.

    Raises
    ------
    ConfigError
        Missing keys, non-positive sizes, heads that do not divide the hidden size.
    """
    missing = [k for k in _REQUIRED if k not in config]
    if missing:
        raise ConfigError(f"config.json lacks {missing}", reason="InvalidConfig")
    hidden = _int(config, "hidden_size")
    inter = _int(config, "intermediate_size")
    layers = _int(config, "num_hidden_layers")
    heads = _int(config, "num_attention_heads")
    kv_heads = _int(config, "num_key_value_heads", heads)
    vocab = _int(config, "vocab_size")
    head_dim = config.get("head_dim") or (hidden // heads)
    if not config.get("head_dim") and hidden % heads:
        raise ConfigError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}",
                          reason="InvalidConfig")
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}",
                          reason="InvalidConfig")
    q, kv = heads * head_dim, kv_heads * head_dim
    bitnet = str(config.get("model_type", "")).lower() == "bitnet"
    attention_bias = bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))

    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": (q, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, q),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        })
        if attention_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
        if mlp_bias:
            out.update({p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,),
                        p + "mlp.down_proj.bias": (hidden,)})
        if bitnet:
            out.update({p + "self_attn.attn_sub_norm.weight": (hidden,), p + "mlp.ffn_sub_norm.weight": (inter,)})
    if not config.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (vocab, hidden)
    return out


@dataclass
class TensorReport:
    name: str
    dtype: str
    shape: list[int]
    count: int
    min: float
    max: float
    mean: float
    std: float
    absmax: float
    nan_count: int
    posinf_count: int
    neginf_count: int
    zero_count: int


@dataclass
class ValidationReport:
    """What :meth:`WeightValidator.validate` found.

    ``ok`` is False when anything is missing, unexpected, mis-shaped, non-finite, of mixed
    dtype, or when the parameter count differs from the expectation.  ``outliers`` are
    notes, not failures (a tensor whose spread is far from its peers').
    """

    path: str
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    mismatched: list[dict] = field(default_factory=list)  # name, expected, actual
    dtypes: dict[str, int] = field(default_factory=dict)  # dtype of the weight matrices -> count
    mixed_dtypes: list[str] = field(default_factory=list)  # matrices not in the majority dtype
    nonfinite: list[dict] = field(default_factory=list)  # name, nan, posinf, neginf
    parameters: int = 0  # every tensor of the checkpoint, named by the config or not
    recognised_parameters: int = 0  # the tensors the config names
    expected_parameters: int = 0
    outliers: list[dict] = field(default_factory=list)  # name, reason
    tensors: list[TensorReport] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        found = []
        if self.missing:
            found.append(f"{len(self.missing)} missing tensor(s): {_some(self.missing)}")
        if self.unexpected:
            found.append(f"{len(self.unexpected)} unexpected tensor(s): {_some(self.unexpected)}")
        for m in self.mismatched:
            found.append(f"{m['name']}: shape {m['actual']}, expected {m['expected']}")
        if self.mixed_dtypes:
            found.append(f"mixed dtypes among weight matrices {self.dtypes}: {_some(self.mixed_dtypes)}")
        for bad in self.nonfinite:
            found.append(f"{bad['name']}: {bad['nan']} NaN, {bad['posinf']} +Inf, {bad['neginf']} -Inf")
        if self.recognised_parameters != self.expected_parameters:
            found.append(f"{self.recognised_parameters:,} parameters in the tensors the config names, "
                         f"expected {self.expected_parameters:,}")
        return found

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        out = asdict(self)
        out["ok"], out["problems"] = self.ok, self.problems
        return out

    def to_json(self, **kw) -> str:
        def clean(x):  # NaN and Inf are not JSON
            if isinstance(x, float) and not math.isfinite(x):
                return str(x)
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, list):
                return [clean(v) for v in x]
            return x

        return json.dumps(clean(self.to_dict()), **kw)

    def __str__(self) -> str:
        lines = [f"{self.path}: {'OK' if self.ok else 'PROBLEMS'} - {self.parameters:,} parameters "
                 f"({self.recognised_parameters:,} in the tensors the config names, expected "
                 f"{self.expected_parameters:,}), weight dtypes {self.dtypes}"]
        lines += [f"  problem: {p}" for p in self.problems]
        lines += [f"  outlier: {o['name']}: {o['reason']}" for o in self.outliers]
        if self.ignored:
            lines.append(f"  ignored: {len(self.ignored)} tensor(s) that carry no weights ({self.ignored[0]}, ...)")
        if self.tensors:
            width = max(len(t.name) for t in self.tensors)
            lines.append(f"  {'name':<{width}}  {'dtype':<5} {'shape':<16} {'mean':>10} {'std':>10} {'absmax':>10}")
            for t in self.tensors:
                lines.append(f"  {t.name:<{width}}  {t.dtype:<5} {str(t.shape):<16} {t.mean:>10.4g} {t.std:>10.4g} "
                             f"{t.absmax:>10.4g}")
        return "\n".join(lines)


def _role(name: str) -> str:
    """The name without its layer number: tensors of one role are compared for outliers."""
    return re.sub(r"\.layers\.\d+\.", ".layers.N.", name)


class WeightValidator:
    """Validate checkpoints against a LLaMA-family config.

    Parameters
    ----------
    config : dict, or path to a ``config.json``
    outlier_factor : float, default 10
        A tensor whose standard deviation is more than this factor above or below the median
        of the tensors of the same role (same name but for the layer number) is an outlier;
        so is a floating-point weight matrix that is all zeros.
    statistics : bool, default True
        Compute per-tensor statistics (one pass over every byte); without them only names,
        shapes, dtypes and the parameter count are checked, from the headers alone.

    Examples
    --------
    >>> report = WeightValidator("model/config.json").validate("model/")  # doctest: +SKIP
    >>> print(report); report.ok
    """

    def __init__(self, config: Mapping[str, Any] | str | os.PathLike, *, outlier_factor: float = 10.0,
                 statistics: bool = True) -> None:
        if not isinstance(config, Mapping):
            try:
                with open(config, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"cannot read config {config!r}: {exc}", reason="InvalidConfig") from exc
            if not isinstance(config, Mapping):
                raise ConfigError("config.json must hold a JSON object", reason="InvalidConfig")
        self.config = dict(config)
        self.expected = expected_tensors(self.config)
        self.outlier_factor = outlier_factor
        self.statistics = statistics
        if statistics:  # fail now, before a check has run, when the kernels cannot
            try:
                from engine.numerics import statistics as _kernels  # noqa: F401
            except ModuleNotFoundError as exc:
                raise MissingDependencyError.of(
                    exc, "WeightValidator's statistics (statistics=False checks names and shapes only)"
                ) from None

    def validate(self, path, *, progress: Callable[[str, int], None] | None = None, **options) -> ValidationReport:
        """Check one ``.safetensors`` file, an index, or a checkpoint directory, or a URL of
        any of them (:func:`engine.open_checkpoint`).

        ``progress``, if given, is called as ``progress(name, nbytes)`` after each tensor;
        ``options`` go to :func:`engine.open_checkpoint` (``headers``, ``timeout``, ... for a URL).

        Notes
        -----
        Copies of tensor bytes: 0 (each tensor is a view of a mapping that the statistics
        kernel reads once).  Memory: one tensor's pages at a time, through the page cache.
        """
        from engine.apps.entry_points import open_checkpoint

        report = ValidationReport(path=os.fspath(path))
        report.expected_parameters = sum(math.prod(s) for s in self.expected.values())
        with open_checkpoint(path, framework="numpy", **options) as ck:
            names = ck.offset_keys()
            present = set(names)
            report.missing = [n for n in self.expected if n not in present]
            matrix_dtypes: dict[str, str] = {}
            for name in names:
                sl = ck.get_slice(name)
                shape, dtype = list(sl.get_shape()), sl.get_dtype()
                report.parameters += math.prod(shape)
                self._check(report, name, dtype, shape, ck, matrix_dtypes)
                if progress is not None:
                    progress(name, math.prod(shape) * BY_NAME[dtype].bits // 8)
        counts = Counter(matrix_dtypes.values())
        report.dtypes = dict(counts)
        if len(counts) > 1:
            majority = counts.most_common(1)[0][0]
            report.mixed_dtypes = [n for n, d in matrix_dtypes.items() if d != majority]
        self._outliers(report)
        return report

    def _check(self, report: ValidationReport, name: str, dtype: str, shape: list, ck,
               matrix_dtypes: dict[str, str]) -> None:
        if name not in self.expected:
            if any(rx.match(name) for rx in _IGNORABLE):
                report.ignored.append(name)
            else:
                report.unexpected.append(name)
            return
        report.recognised_parameters += math.prod(shape)
        if tuple(shape) != self.expected[name]:
            report.mismatched.append(dict(name=name, expected=list(self.expected[name]), actual=shape))
        if len(shape) == 2:
            matrix_dtypes[name] = dtype
        if self.statistics:
            self._summarise(report, name, dtype, shape, ck)

    def _summarise(self, report: ValidationReport, name: str, dtype: str, shape: list, ck) -> None:
        from engine.numerics.statistics import stats

        try:
            s = stats(ck.get_tensor(name))
        except TypeError:  # dtypes the kernel does not summarise (FP8, packed sub-byte)
            return
        t = TensorReport(name, dtype, shape, s.count, float(s.min), float(s.max), s.mean, s.std, float(s.absmax),
                         s.nan_count, s.posinf_count, s.neginf_count, s.zero_count)
        report.tensors.append(t)
        if s.nan_count or s.posinf_count or s.neginf_count:
            report.nonfinite.append(dict(name=name, nan=s.nan_count, posinf=s.posinf_count, neginf=s.neginf_count))

    def _outliers(self, report: ValidationReport) -> None:
        by_role: dict[str, list[TensorReport]] = {}
        for t in report.tensors:
            by_role.setdefault(_role(t.name), []).append(t)
            if len(t.shape) == 2 and t.count and t.zero_count == t.count and t.dtype.startswith(("F", "BF")):
                report.outliers.append(dict(name=t.name, reason="all zeros"))
        f = self.outlier_factor
        for peers in by_role.values():
            stds = sorted(t.std for t in peers if math.isfinite(t.std))
            if len(stds) < 3:
                continue
            median = stds[len(stds) // 2]
            if median <= 0:
                continue
            for t in peers:
                if math.isfinite(t.std) and (t.std > median * f or t.std < median / f):
                    report.outliers.append(dict(
                        name=t.name, reason=f"std {t.std:.4g} against a median of {median:.4g} for its peers"))


def _some(names: list[str], shown: int = 5) -> str:
    """The first ``shown`` names, and how many more there are."""
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
